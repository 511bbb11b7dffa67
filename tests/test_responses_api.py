"""OpenAI's Responses API (POST /v1/responses) through a real server and the real openai client.

A response is served as the chat turn it describes, so the oracle is /v1/chat/completions on the
same conversation: the same greedy text and token counts, streamed or not. A stored response
continued by previous_response_id answers as the whole conversation sent at once does. What a
text-only server cannot do is a 400 that names the field, and no hostile value earns a 5xx or
leaks a block.
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from server_process import TINY_SERVER, ServerProcess
from test_fuzz import NASTY

pytestmark = pytest.mark.usefixtures("no_leaks")

SYSTEM = "Answer briefly."
QUESTION = "Describe a pet"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(tiny_model_dir, *TINY_SERVER, "--max-model-len", "1024") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


def chat_answer(client, messages, max_tokens=12, **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=max_tokens, temperature=0, **kw
    )


def test_a_response_is_the_chat_answer_to_its_conversation(client):
    r = client.responses.create(
        model="tiny",
        instructions=SYSTEM,
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        metadata={"run": "7"},
    )
    c = chat_answer(
        client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == c.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        c.usage.prompt_tokens,
        c.usage.completion_tokens,
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the request's settings, as OpenAI reports them
    assert (r.instructions, r.max_output_tokens, r.temperature) == (SYSTEM, 12, 0)
    assert r.metadata == {"run": "7"} and r.store is True and r.tool_choice == "auto"
    expect_status = "incomplete" if c.choices[0].finish_reason == "length" else "completed"
    assert r.status == expect_status


def test_input_items_are_the_conversation(client):
    """A list of messages, an earlier answer sent back as OpenAI returned it (its id, status and
    annotations), equals the chat of those messages; without instructions no system message."""
    first = client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=6, temperature=0
    )
    earlier = first.output[0].model_dump(exclude_none=True)
    turns = [{"role": "user", "content": QUESTION}, earlier, {"role": "user", "content": "More"}]
    r = client.responses.create(model="tiny", input=turns, max_output_tokens=10, temperature=0)
    c = chat_answer(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More"},
        ],
        max_tokens=10,
    )
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_the_stream_builds_the_same_response(client):
    kw = dict(model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=20)
    whole = client.responses.create(**kw, temperature=0)
    events = list(client.responses.create(**kw, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        end,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == whole.output_text  # (the server may merge steps)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.id.startswith("resp_")
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_ids = {e.item.id for e in events if e.type.startswith("response.output_item")}
    assert item_ids == {final.output[0].id}


def test_max_output_tokens_leaves_it_incomplete(client, server):
    kw = dict(model="tiny", input=QUESTION, max_output_tokens=3, temperature=0)
    r = client.responses.create(**kw, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(client.responses.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text


def test_the_request_id_header_names_the_response(server):
    answer = server.http.post(
        "/v1/responses",
        json={"model": "tiny", "input": "hi", "max_output_tokens": 2},
        headers={"X-Request-Id": "abc123"},
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["id"] == "resp_abc123" and body["output"][0]["id"] == "msg_abc123"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_format_json_schema_constrains_the_output(client, seed):
    r = client.responses.create(
        model="tiny",
        input=QUESTION,
        max_output_tokens=200,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        extra_body={"seed": seed},
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_sampling_extensions_pass_through(client):
    """seed makes sampled answers repeat; a stop string ends one, as on /v1/chat/completions."""
    kw = dict(model="tiny", input=QUESTION, max_output_tokens=12, temperature=1.0)
    a = client.responses.create(**kw, extra_body={"seed": 5})
    b = client.responses.create(**kw, extra_body={"seed": 5})
    assert a.output_text == b.output_text
    c = chat_answer(client, [{"role": "user", "content": QUESTION}], stop=[a.output_text[2:4]])
    r = client.responses.create(
        model="tiny",
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
        extra_body={"stop": [a.output_text[2:4]]},
    )
    assert r.output_text == c.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "no stored response"),
        ({"conversation": "conv_1"}, None, "not stored"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        (
            {"tools": [{"type": "function", "name": "f"}]},
            "tool_choice",
            "--enable-auto-tool-choice",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"include": ["message.output_text.logprobs"]}, None, "include"),
        ({"reasoning": {"summary": "auto"}}, None, "reasoning.summary is not supported"),
        ({"reasoning": {"effort": "extreme"}}, None, "reasoning.effort"),
        ({"truncation": "auto"}, None, "truncation"),
        ({"top_logprobs": 3}, None, "top_logprobs"),
        ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input", "computer_call"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input", "output"),
        (
            {
                "input": [
                    {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "x"}]}
                ]
            },
            "input",
            "reasoning item",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens=100000 plus"),
        ({"temperature": 9}, "temperature", ""),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_the_field(server, fields, param, words):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **fields}
    answer = server.http.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    if param:
        assert error["param"] and error["param"].startswith(param), error


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "additionalProperties": False, "properties": {}},
}


def as_chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_a_required_call_is_a_function_call_item_as_chat_calls_it(client):
    """Seeded sampling (greedy text from a random model may not end its call): the same seed gives
    the same call through both endpoints."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    same = dict(model="tiny", tool_choice="required", parallel_tool_calls=False, temperature=1.0)
    kw = dict(same, input=ask, tools=[WEATHER], max_output_tokens=200, extra_body={"seed": 0})
    r = client.responses.create(**kw)
    c = client.chat.completions.create(
        **same, messages=ask, tools=[as_chat_tool(WEATHER)], max_completion_tokens=200, seed=0
    )
    calls = [item for item in r.output if item.type == "function_call"]
    expected = c.choices[0].message.tool_calls
    assert [(x.name, x.arguments) for x in calls] == [
        (t.function.name, t.function.arguments) for t in expected
    ]
    assert calls and all(x.call_id.startswith("call_") and x.status == "completed" for x in calls)
    assert "city" in json.loads(calls[0].arguments)
    assert c.choices[0].finish_reason == "tool_calls" and r.status == "completed"
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    # streamed: the arguments grow by deltas into what the Response holds, under one call id
    events = list(client.responses.create(**kw, stream=True))
    final = events[-1].response
    streamed = [i for i in final.output if i.type == "function_call"]
    assert [(x.name, x.arguments) for x in streamed] == [(x.name, x.arguments) for x in calls]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == "".join(x.arguments for x in streamed)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert {a.call_id for a in added if a.type == "function_call"} == {x.call_id for x in streamed}


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_call_streamed_or_not(client):
    """A call cut short stays a function_call item (incomplete, its arguments so far), the same
    in the Response and at the end of its stream, not the raw text as a message."""
    note = {
        "type": "function",
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"s": {"type": "string"}},
            "required": ["s"],
        },
    }
    cut = None
    for limit in (30, 40, 60, 90):
        kw = dict(
            model="tiny",
            input="Take a note",
            tools=[note],
            tool_choice="required",
            max_output_tokens=limit,
            temperature=1.0,
            extra_body={"seed": 3},
        )
        r = client.responses.create(**kw)
        items = [(i.type, bool(getattr(i, "arguments", ""))) for i in r.output]
        if r.status == "incomplete" and items == [("function_call", True)]:
            cut = r
            break
    assert cut is not None, "no limit cut the call inside its arguments"
    (call,) = cut.output
    assert call.status == "incomplete" and call.name == "note" and call.arguments
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.incomplete"
    (streamed,) = events[-1].response.output
    assert (streamed.type, streamed.status, streamed.arguments) == (
        "function_call",
        "incomplete",
        call.arguments,
    )
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"]


def test_a_named_function_is_the_one_called(client):
    r = client.responses.create(
        model="tiny",
        input="What time is it?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200,
        temperature=0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert [x.name for x in calls] == ["get_time"]


def test_calls_and_their_outputs_sent_back_are_the_chats_tool_turns(client):
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    r = client.responses.create(
        model="tiny",
        input=turns,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=10,
        temperature=0,
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    c = client.chat.completions.create(
        model="tiny",
        messages=[
            turns[0],
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        tools=[as_chat_tool(WEATHER)],
        tool_choice="none",
        max_completion_tokens=10,
        temperature=0,
    )
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi", max_output_tokens=2)


def top(name: str):
    return lambda v: {name: v}


FIELDS = {
    "model": lambda v: {"model": v},
    "input": lambda v: {"input": v},
    "input.0.role": lambda v: {"input": [{"role": v, "content": "hi"}]},
    "input.0.content": lambda v: {"input": [{"role": "user", "content": v}]},
    "input.0.content.0.text": lambda v: {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": v}]}]
    },
    "input.0.type": lambda v: {"input": [{"type": v, "role": "user", "content": "hi"}]},
    **{
        name: top(name)
        for name in (
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "text",
            "metadata",
            "user",
            "store",
            "previous_response_id",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "truncation",
            "include",
            "top_logprobs",
            "reasoning",
            "seed",
            "stop",
            "top_k",
            "logit_bias",
        )
    },
    "text.format": lambda v: {"text": {"format": v}},
    "tools.0": lambda v: {"tools": [v]},
    "tools.0.parameters": lambda v: {"tools": [{"type": "function", "name": "f", "parameters": v}]},
    "tool_choice.name": lambda v: {"tool_choice": {"type": "function", "name": v}},
    "input.0.arguments": lambda v: {
        "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": v}]
    },
    "text.format.schema": lambda v: {"text": {"format": {"type": "json_schema", "schema": v}}},
}


def test_no_hostile_value_in_any_field_is_a_5xx(server):
    for field, put in FIELDS.items():
        for value in NASTY:
            body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **put(value)}
            answer = server.http.post(
                "/v1/responses",
                content=json.dumps(body, allow_nan=True).encode(),
                headers={"Content-Type": "application/json"},
            )
            assert answer.status_code < 500, (field, value, answer.text[:300])
            if answer.status_code >= 400:
                assert answer.json()["error"]["message"], (field, value)
    assert server.http.get("/health").status_code == 200
    snap = server.wait_idle()
    assert snap["used"] == 0 and "Traceback" not in server.output()


# ---------------------------------------------------------------- stored responses


def test_previous_response_id_continues_the_stored_conversation(client):
    """Each turn answers as the whole conversation sent at once does (greedy text, prompt
    tokens); the earlier turns' instructions do not carry over, as in OpenAI's."""
    kw = dict(model="tiny", max_output_tokens=8, temperature=0)
    first = client.responses.create(**kw, instructions="Be terse.", input=QUESTION)
    second = client.responses.create(**kw, previous_response_id=first.id, input="More")
    third = client.responses.create(
        **kw, instructions=SYSTEM, previous_response_id=second.id, input="Why?"
    )
    whole = [
        {"role": "user", "content": QUESTION},
        first.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "More"},
        second.output[0].model_dump(exclude_none=True),
        {"role": "user", "content": "Why?"},
    ]
    sent = client.responses.create(**kw, instructions=SYSTEM, input=whole)
    assert third.output_text == sent.output_text and third.output_text
    assert third.usage.input_tokens == sent.usage.input_tokens
    c = chat_answer(
        client,
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "More"},
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "Why?"},
        ],
        max_tokens=8,
    )
    assert third.output_text == c.choices[0].message.content
    assert third.usage.input_tokens == c.usage.prompt_tokens
    assert (third.previous_response_id, first.previous_response_id) == (second.id, None)
    # continued but not kept itself
    fourth = client.responses.create(**kw, previous_response_id=third.id, input="Ok", store=False)
    assert fourth.store is False and fourth.previous_response_id == third.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(fourth.id)


def test_a_call_answered_through_previous_response_id(client):
    """The agent loop: the model calls a function; the next request sends only the call's output
    and the previous response's id, and is answered as if the call were sent back with it."""
    kw = dict(model="tiny", tools=[WEATHER], temperature=0)
    ask = "Weather in Paris?"
    called = client.responses.create(
        **kw, input=ask, tool_choice="required", parallel_tool_calls=False, max_output_tokens=200
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    after = dict(kw, tool_choice="none", max_output_tokens=10)
    r = client.responses.create(**after, previous_response_id=called.id, input=[output])
    sent = client.responses.create(
        **after,
        input=[{"role": "user", "content": ask}, call.model_dump(exclude_none=True), output],
    )
    assert r.output_text == sent.output_text
    assert r.usage.input_tokens == sent.usage.input_tokens


def test_a_stored_response_is_retrieved_listed_and_deleted(client, server):
    first = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=5)
    r = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"role": "user", "content": "One"}, {"role": "user", "content": "Two"}],
        max_output_tokens=5,
    )
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = client.responses.input_items.list(r.id)  # its own request's, newest first
    texts = [item.content[0].text for item in items.data]
    assert texts == ["Two", "One"] and not items.has_more
    path = f"/v1/responses/{r.id}/input_items"
    page = server.http.get(path, params={"order": "asc", "limit": 1}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["One"] and page["has_more"]
    rest = server.http.get(path, params={"order": "asc", "after": page["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Two"] and not rest["has_more"]
    unknown = server.http.get(f"/v1/responses/{r.id}", params={"include": "x"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "include"
    gone = server.http.delete(f"/v1/responses/{first.id}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="earlier turn"):  # the chain is broken
        client.responses.create(model="tiny", previous_response_id=r.id, input="x")


def test_an_answer_may_not_continue_itself(client):
    """A request id (the answer's id) reused with previous_response_id naming it would make the
    kept conversation a loop."""
    first = client.responses.create(
        model="tiny", input="a", max_output_tokens=2, extra_body={"request_id": "same"}
    )
    assert first.id == "resp_same"
    with pytest.raises(openai.BadRequestError, match="another request id"):
        client.responses.create(
            model="tiny",
            input="b",
            max_output_tokens=2,
            previous_response_id=first.id,
            extra_body={"request_id": "same"},
        )
    again = client.responses.create(
        model="tiny", input="b", max_output_tokens=2, previous_response_id=first.id
    )
    assert again.id != first.id and again.previous_response_id == first.id


def test_store_false_and_streamed_answers(client):
    kept_not = client.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=4, store=False
    )
    assert kept_not.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_not.id)
    kw = dict(model="tiny", input=QUESTION, max_output_tokens=6, stream=True)
    events = list(client.responses.create(**kw))
    final = events[-1].response
    assert final.store is True and events[0].response.store is True
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_the_store_keeps_the_latest_and_can_be_off(tiny_model_dir):
    args = (*TINY_SERVER, "--max-model-len", "1024", "--max-stored-responses")
    kw = dict(model="tiny", max_output_tokens=3)
    with ServerProcess(tiny_model_dir, *args, "2") as srv:
        client = srv.openai()
        a = client.responses.create(**kw, input="a")
        b = client.responses.create(**kw, previous_response_id=a.id, input="b")
        client.responses.create(**kw, previous_response_id=b.id, input="c")  # a leaves
        with pytest.raises(openai.NotFoundError, match="keeps the latest 2"):
            client.responses.retrieve(a.id)
        with pytest.raises(openai.BadRequestError, match="earlier turn"):
            client.responses.create(**kw, previous_response_id=b.id, input="d")
        srv.wait_idle()
    with ServerProcess(tiny_model_dir, *args, "0") as srv:
        client = srv.openai()
        r = client.responses.create(**kw, input="a")
        assert r.store is False
        for field in ({"store": True}, {"previous_response_id": r.id}, {"background": True}):
            with pytest.raises(openai.BadRequestError, match="--max-stored-responses 0"):
                client.responses.create(**kw, input="a", **field)
        srv.wait_idle()


# ---------------------------------------------------------------- background responses


def poll(client, response_id: str, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < end, "the background response never ended"
        time.sleep(0.05)
    return r


def test_a_background_response_is_polled_until_done(client, server):
    kw = dict(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0)
    queued = client.responses.create(**kw, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    done = poll(client, queued.id)
    same = client.responses.create(**kw)
    assert done.status == same.status == "incomplete" and done.background is True  # (8 tokens)
    assert done.output_text == same.output_text and done.output_text
    assert done.usage.output_tokens == same.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="not running"):
        client.responses.cancel(queued.id)
    after = client.responses.create(**kw, previous_response_id=done.id)
    assert after.previous_response_id == done.id
    server.wait_idle()


def test_a_cancelled_background_response_frees_its_blocks(client, server):
    r = client.responses.create(  # 900 tokens: running still when it is cancelled
        model="tiny",
        input=QUESTION,
        max_output_tokens=900,
        background=True,
        extra_body={"ignore_eos": True, "request_id": "long"},
    )
    with pytest.raises(openai.BadRequestError, match="still running"):
        client.responses.create(model="tiny", input="x", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError, match="is running: send another request id"):
        client.responses.create(
            model="tiny", input="x", background=True, extra_body={"request_id": "long"}
        )
    end = time.monotonic() + 60
    while client.responses.retrieve(r.id).status == "queued":  # until the engine runs it
        assert time.monotonic() < end
        time.sleep(0.01)
    assert client.responses.retrieve(r.id).status == "in_progress"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert server.wait_idle()["used"] == 0
    # deleted while it runs: stopped first, so that its end does not keep it again
    running = client.responses.create(
        model="tiny",
        input=QUESTION,
        max_output_tokens=900,
        background=True,
        extra_body={"ignore_eos": True},
    )
    client.responses.delete(running.id)
    assert server.wait_idle()["used"] == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(running.id)


def test_a_background_response_is_stored(server):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "background": True}
    answer = server.http.post("/v1/responses", json={**body, "store": False})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "background"


def test_a_streamed_background_response_is_read_again_from_any_point(client, server):
    """background and stream: the events as they come, kept; GET ?stream=true reads them again,
    all or those after a sequence number, and the stored Response is the stream's answer."""
    kw = dict(model="tiny", input=QUESTION, max_output_tokens=8, temperature=0)
    events = [
        e.model_dump()
        for e in client.responses.create(**kw, background=True, stream=True, timeout=60)
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["background"]
    assert events[-1]["type"] == "response.incomplete"  # (8 tokens)
    response_id = events[0]["response"]["id"]
    kept = client.responses.retrieve(response_id)
    same = client.responses.create(**kw)
    assert kept.status == "incomplete" and kept.output_text == same.output_text != ""
    assert kept.output_text == events[-1]["response"]["output"][-1]["content"][0]["text"]
    again = [
        e.model_dump() for e in client.responses.retrieve(response_id, stream=True, timeout=60)
    ]
    assert again == events
    after = client.responses.retrieve(response_id, stream=True, starting_after=3, timeout=60)
    assert [e.model_dump() for e in after] == events[4:]
    with pytest.raises(openai.BadRequestError, match="was not streamed in the background"):
        client.responses.retrieve(same.id, stream=True)
    with pytest.raises(openai.BadRequestError, match="starting_after goes with stream"):
        client.responses.retrieve(response_id, starting_after=3)
    server.wait_idle()


def test_a_streamed_background_response_runs_on_without_its_client_and_can_be_cancelled(
    client, server
):
    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 24, "background": True,
            "stream": True, "ignore_eos": True}  # fmt: skip
    with server.http.stream("POST", "/v1/responses", json=body) as s:  # gone after one event
        first = json.loads(next(line for line in s.iter_lines() if line.startswith("data:"))[5:])
    done = poll(client, first["response"]["id"])
    assert done.status == "incomplete" and done.usage.output_tokens == 24
    replayed = list(client.responses.retrieve(done.id, stream=True, timeout=60))
    assert (replayed[0].type, replayed[0].sequence_number) == (first["type"], 0)
    assert replayed[0].response.id == done.id and replayed[-1].response.status == "incomplete"
    # cancelled while its stream is read: the stream ends, the blocks are freed
    with server.http.stream("POST", "/v1/responses", json={**body, "max_output_tokens": 900}) as s:
        lines = s.iter_lines()
        started = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        response_id = started["response"]["id"]
        next(line for line in lines if '"response.output_text.delta"' in line)  # it runs
        assert client.responses.cancel(response_id).status == "cancelled"
        rest = list(lines)  # (ends: were it left open, this would wait for ever)
    assert not any(
        '"response.completed"' in line or '"response.incomplete"' in line for line in rest
    )
    assert client.responses.retrieve(response_id).status == "cancelled"
    assert server.wait_idle()["used"] == 0

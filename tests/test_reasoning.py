"""--reasoning-parser: the rule on its own, then a real server on a tiny model whose vocabulary has
`<think>` and `</think>` (added tokens, as DeepSeek-R1's and Qwen3's).

The random model never closes a section by itself, so a small logit_bias on `</think>` makes it
close one a few tokens in; the output's own token ids (return_token_ids) are the raw text the
response is checked against.
"""

from __future__ import annotations

import json

import pytest
from server_process import TINY_SERVER, ServerProcess, serve_error
from tiny_model import make_tiny_model

from pagedkv.engine.reasoning import (
    END,
    FORMATS,
    START,
    ReasoningSplit,
    ReasoningTags,
    Section,
    ThinkState,
)
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.server.protocol import ChatMessage

MESSAGES = [{"role": "user", "content": "Hello world!"}]
TEXTS = [
    "",
    "plain answer",
    "<think>plan</think>answer",
    "<think>plan",
    "plan</think>answer",
    "plan</think>",
    "<think></think>",
    "a</think>b</think>c",
    "</thi",
    "<thin",
]


# ---------------------------------------------------------------- the rule


def split_reasoning(text: str, first: Section, final: bool, parser: str = "qwen3"):
    return ReasoningSplit(FORMATS[parser].marks, first).split(text, final)


@pytest.mark.parametrize("first", [Section.THINK, Section.EITHER])
@pytest.mark.parametrize("text", TEXTS)
def test_a_streamed_split_only_grows_and_ends_as_the_whole(first, text):
    """Every prefix's split (held back while a tag may be forming) is a prefix of the final one,
    so the stream's pieces add up to the non-streamed answer."""
    reasoning, content = split_reasoning(text, first, final=True)
    for k in range(len(text) + 1):
        r, c = split_reasoning(text[:k], first, final=False)
        assert reasoning.startswith(r) and content.startswith(c), (text[:k], r, c)
        assert not (c and len(r) < len(reasoning)), "content came before the reasoning ended"


def test_the_split_of_each_section():
    think, either = Section.THINK, Section.EITHER
    assert split_reasoning("<think>plan</think>answer", either, True) == ("plan", "answer")
    assert split_reasoning("<think>plan</think>answer", think, True) == ("plan", "answer")
    assert split_reasoning("plan</think>answer", think, True) == ("plan", "answer")
    assert split_reasoning("plan</think>answer", either, True) == ("", "plan</think>answer")
    assert split_reasoning("plan", think, True) == ("plan", "")  # cut off while thinking
    assert split_reasoning("plan</thi", think, False) == ("plan", "")  # the tag may be forming
    assert split_reasoning("a</think>b</think>c", think, True) == ("a", "b</think>c")
    assert split_reasoning("<thi", either, False) == ("", "")
    assert split_reasoning("<thi", either, True) == ("", "<thi")


def test_the_prompt_and_the_first_token_decide_the_section():
    dsr1, qwen3 = ReasoningTags("deepseek_r1", 7, 8), ReasoningTags("qwen3", 7, 8)
    assert dsr1.first_section([1, 2]) is Section.THINK  # R1 thinks first
    assert qwen3.first_section([1, 2]) is Section.EITHER
    for tags in (dsr1, qwen3):
        assert tags.first_section([1, 7, 2]) is Section.THINK  # the template opened one
        assert tags.first_section([7, 2, 8, 3]) is Section.EITHER  # ... or closed an empty one
        assert tags.first_section([8, 1, 7]) is Section.THINK  # the last tag decides
    state = ThinkState.of(qwen3, [1], [])
    assert [state.step(t) for t in (7, 3, 8, 4, 8)] == [False, False, False, True, True]
    state = ThinkState.of(qwen3, [1], [])
    assert [state.step(t) for t in (3, 7)] == [True, True]  # no <think> first: all answer
    assert ThinkState.of(dsr1, [1], [7, 3, 8]).section is Section.ANSWER


def test_a_vocabulary_without_the_tags_is_refused(tiny_model_dir):
    from pagedkv.config import ConfigError

    with pytest.raises(ConfigError, match="no <think> token"):
        ReasoningTags.of("deepseek_r1", Tokenizer.from_hf_folder(tiny_model_dir))


def test_an_earlier_answers_reasoning_reaches_the_template_under_the_name_templates_read():
    for field in ("reasoning", "reasoning_content"):
        msg = ChatMessage(role="assistant", content="4", **{field: "2+2"})
        assert msg.as_template_input()["reasoning_content"] == "2+2"


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def think_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("think") / "model", think_tags=True)


@pytest.fixture(scope="module")
def server(think_model):
    with ServerProcess(
        think_model,
        *TINY_SERVER,
        "--reasoning-parser",
        "deepseek_r1",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tags(think_model) -> ReasoningTags:
    return ReasoningTags.of("deepseek_r1", Tokenizer.from_hf_folder(think_model))


def chat(server, **kw) -> dict:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 16,
        "return_token_ids": True,
        **kw,
    }
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def raw_text(server, **kw) -> str:
    """The same chat request's output as the model wrote it: a completion of its prompt's ids
    (completions are never split)."""
    extra = {k: kw.pop(k) for k in ("chat_template_kwargs",) if k in kw}
    r = server.http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, **extra})
    assert r.status_code == 200, r.text
    body = {"model": "tiny", "prompt": r.json()["tokens"], "temperature": 0, "max_tokens": 16}
    r = server.http.post("/v1/completions", json={**body, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream(server, **kw) -> tuple[str, str, list[dict]]:
    body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 16, **kw}
    reasoning, content, chunks = "", "", []
    with server.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                chunks.append(chunk)
                for choice in chunk["choices"]:
                    reasoning += choice["delta"].get("reasoning") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning, content, chunks


@pytest.fixture(scope="module")
def closing_bias(server, tags) -> dict:
    """A logit_bias under which the model closes its section a few tokens in, with an answer
    after it (found on this model, greedy)."""
    for bias in [b / 4 for b in range(2, 33)]:  # 0.5 .. 8: wide, for any CPU's rounding
        ids = chat(server, logit_bias={str(tags.end_id): bias})["choices"][0]["token_ids"]
        if tags.end_id in ids and 1 <= ids.index(tags.end_id) <= 12:
            return {str(tags.end_id): bias}
    raise AssertionError("no bias closes the section inside the output")


def test_the_section_becomes_reasoning_and_the_rest_content(server, closing_bias):
    message = chat(server, logit_bias=closing_bias)["choices"][0]["message"]
    before, after = raw_text(server, logit_bias=closing_bias).split(END, 1)
    assert message["reasoning"] == before.removeprefix(START) and before
    assert message["content"] == after and after
    # streamed: the same pieces, reasoning first
    reasoning, content, chunks = stream(server, logit_bias=closing_bias)
    assert (reasoning, content) == (message["reasoning"], message["content"])
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    kinds = [k for d in deltas for k in ("reasoning", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # never reasoning after content
    # include_reasoning false: the answer alone
    bare = chat(server, logit_bias=closing_bias, include_reasoning=False)["choices"][0]["message"]
    assert bare.get("reasoning") is None and bare["content"] == message["content"]
    assert stream(server, logit_bias=closing_bias, include_reasoning=False)[:2] == ("", content)


def test_an_output_that_never_closes_its_section_is_all_reasoning(server, tags):
    never = {"logit_bias": {str(tags.end_id): -100}, "ignore_eos": True}  # on any CPU's rounding
    choice = chat(server, **never)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning"] == raw_text(server, **never)
    assert choice["message"]["content"] is None


def respond(server, stream: bool = False, **kw):
    """/v1/responses for the same conversation: the body, or the stream's events."""
    body = {"model": "tiny", "input": MESSAGES, "temperature": 0, "max_output_tokens": 16, **kw}
    if not stream:
        r = server.http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return r.json()
    events = []
    with server.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_a_response_holds_the_reasoning_item_before_the_message(server, closing_bias, think_model):
    message = chat(server, logit_bias=closing_bias)["choices"][0]["message"]
    body = respond(server, logit_bias=closing_bias)
    reasoning, answer = body["output"]
    assert reasoning["type"] == "reasoning" and answer["type"] == "message"
    assert reasoning["content"][0]["text"] == message["reasoning"]
    assert answer["content"][0]["text"] == message["content"]
    tok = Tokenizer.from_hf_folder(think_model)
    counted = len(tok.encode(message["reasoning"], add_special_tokens=False))
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == counted > 0
    # streamed: the reasoning item opens, grows and closes before the message item opens
    events = respond(server, stream=True, logit_bias=closing_bias)
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, said) == (message["reasoning"], message["content"])
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")

    def unnamed(items: list[dict]) -> list[dict]:
        return [{k: v for k, v in item.items() if k != "id"} for item in items]

    assert unnamed(events[-1]["response"]["output"]) == unnamed(body["output"])
    # include_reasoning false: the message alone (a chat extension, passed through)
    bare = respond(server, logit_bias=closing_bias, include_reasoning=False)
    assert [item["type"] for item in bare["output"]] == ["message"]
    assert (
        bare["usage"]["output_tokens_details"]["reasoning_tokens"] == counted
    )  # spent all the same


def test_a_prompt_that_closed_the_section_is_answered_as_content(server):
    """enable_thinking false: the template closes an empty section; the output is the answer."""
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(server, **kwargs)["choices"][0]["message"]
    assert message.get("reasoning") is None
    assert message["content"] == raw_text(server, **kwargs) and message["content"]


def test_a_grammar_constrains_the_answer_after_the_reasoning(server, tags, closing_bias):
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    free = chat(server, logit_bias=closing_bias)["choices"][0]
    forced = chat(server, logit_bias=closing_bias, **choice)["choices"][0]
    k = free["token_ids"].index(tags.end_id)
    assert forced["token_ids"][: k + 1] == free["token_ids"][: k + 1]  # thinking was free
    assert forced["message"]["content"] in ("yes", "no")
    assert forced["message"]["reasoning"] == free["message"]["reasoning"]
    assert forced["finish_reason"] == "stop"
    # a prompt that closed the section: the grammar holds from the first token
    closed = chat(server, chat_template_kwargs={"enable_thinking": False}, **choice)
    assert closed["choices"][0]["message"]["content"] in ("yes", "no")
    # ... where the model may still open a section first, which the grammar then waits for
    opened = chat(
        server,
        chat_template_kwargs={"enable_thinking": False},
        logit_bias={str(tags.start_id): 100},
        **choice,
    )["choices"][0]
    assert opened["token_ids"][0] == tags.start_id
    assert opened["finish_reason"] == "length" and opened["message"]["content"] is None


def test_a_required_tool_call_follows_the_reasoning(server, closing_bias):
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    body = chat(
        server, logit_bias=closing_bias, tools=[tool], tool_choice="required", max_tokens=64
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "ping"
    assert choice["message"]["reasoning"]  # the section before the call
    assert "<tool_call>" not in choice["message"]["reasoning"]


def test_an_earlier_answers_reasoning_is_accepted_in_the_conversation(server):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "Hi.", "reasoning": "a greeting"},
        {"role": "user", "content": "Again?"},
    ]
    assert chat(server, messages=history)["choices"][0]["finish_reason"] == "length"


def test_a_parser_the_model_cannot_serve_is_one_line_and_exit_2(tiny_model_dir):
    lines = serve_error("--model", tiny_model_dir, "--reasoning-parser", "deepseek_r1")
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and "no <think> token" in lines[-1], lines
    assert not any("loaded" in line for line in lines), lines  # before the weights load
    lines = serve_error("--model", tiny_model_dir, "--reasoning-parser", "mistral")
    assert "no [THINK] token" in lines[-1], lines
    lines = serve_error("--model", tiny_model_dir, "--reasoning-parser", "olmo3")
    assert len(lines) == 1 and "deepseek_r1, qwen3, mistral, granite" in lines[0], lines


def test_completions_are_left_as_the_model_wrote_them(server, closing_bias):
    """As in vLLM, only chat answers are split; a completion's text keeps its tags."""
    r = server.http.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Hello world!",
            "max_tokens": 16,
            "temperature": 0,
            "logit_bias": closing_bias,
        },
    )
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert END in choice["text"] and "reasoning" not in choice


# ---------------------------------------------------------------- thinking_token_budget


def test_a_thinking_budget_is_forced_after_that_many_tokens():
    tags = ReasoningTags("qwen3", 7, 8, closing=(5, 6, 8))  # a phrase, then the closing tag
    state = ThinkState.of(tags, [1, 7], [])
    drawn = []
    for _ in range(6):
        token = state.forced(2)
        drawn.append(token)
        state.step(3 if token is None else token)
    assert drawn == [None, None, 5, 6, 8, None]  # two free, the phrase, then the answer
    assert state.section is Section.ANSWER
    undecided = ThinkState.of(tags, [1], [])
    assert undecided.forced(0) is None  # nothing to close before a section opens
    undecided.step(7)
    assert undecided.forced(0) == 5  # ... and at once after it opens with a budget of 0


def detokenized(server, ids: list[int]) -> str:
    r = server.http.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("budget", [0, 3])
def test_a_thinking_budget_closes_the_section(server, tags, budget):
    """The section ends after `budget` tokens (a random model never ends one by itself), the same
    tokens as without a budget before that; the rest is the answer, streamed alike."""
    free = chat(server, ignore_eos=True)["choices"][0]
    assert tags.end_id not in free["token_ids"]
    choice = chat(server, ignore_eos=True, thinking_token_budget=budget)["choices"][0]
    ids = choice["token_ids"]
    assert ids[:budget] == free["token_ids"][:budget] and ids[budget] == tags.end_id
    message = choice["message"]
    reasoning = message["reasoning"] or ""
    assert reasoning == detokenized(server, ids[:budget]) and message["content"]
    # the same request as a completion (never split) is closed alike
    assert raw_text(server, ignore_eos=True, thinking_token_budget=budget) == (
        reasoning + END + message["content"]
    )
    streamed = stream(server, ignore_eos=True, thinking_token_budget=budget)
    assert streamed[:2] == (reasoning, message["content"])
    # a budget the output never reaches changes nothing
    roomy = chat(server, ignore_eos=True, thinking_token_budget=16)["choices"][0]
    assert roomy["token_ids"] == free["token_ids"]


def test_a_grammar_takes_over_where_the_budget_closed_the_section(server, tags):
    choice = chat(server, thinking_token_budget=2, structured_outputs={"choice": ["yes", "no"]})[
        "choices"
    ][0]
    assert choice["token_ids"][2] == tags.end_id
    assert choice["message"]["content"] in ("yes", "no") and choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "extra",
    [{"thinking_token_budget": -1}, {"thinking_token_budget": 2, "use_beam_search": True, "n": 2}],
)
def test_a_bad_thinking_budget_is_a_400_naming_it(server, extra):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "thinking_token_budget", r.text

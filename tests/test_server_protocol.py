"""The OpenAI request models: strict types, prompt shapes, and the mapping to SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedkv.config import ConfigError
from pagedkv.engine.request import ParamError
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.server.responses import ChatDelta
from pagedkv.server.validation import IGNORED


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        (["a", [4]], ["a", [4]]),
    ],
)
def test_prompt_shapes_become_a_batch(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize(
    "prompt", ["", [], [[]], ["ok", ""], 5, [1, "a"], [1.5], [True], {"a": 1}, None, [[1, [2]]]]
)
def test_bad_prompts_are_rejected_with_the_field_named(prompt):
    with pytest.raises(ValidationError) as err:
        completion(prompt=prompt)
    assert err.value.errors()[0]["loc"][0] == "prompt"


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "16"),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", "hot"),
        ("n", 2.0),
        ("stream", "yes"),
        ("seed", "1"),
        ("stop", 3),
        ("stop", ["a", 1]),
        ("stop_token_ids", [1, "x"]),
        ("stream_options", {"include_usage": "yes"}),
        ("logprobs", "2"),
    ],
)
def test_wrong_types_are_rejected_not_coerced(field, value):
    with pytest.raises(ValidationError) as err:
        completion(**{field: value})
    assert err.value.errors()[0]["loc"][0] == field


def test_defaults_and_nulls_map_to_sampling_defaults():
    p = completion(
        temperature=None, top_p=None, top_k=None, presence_penalty=None
    ).sampling_params()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (
        1,
        1.0,
        1.0,
        -1,
        16,
        None,
    )
    assert chat().sampling_params().max_tokens is None  # chat: up to the context


def test_fields_openai_lets_be_null_take_their_defaults():
    """OpenAI's spec (and vLLM) let n, stream, echo, chat logprobs and stream_options' flags be
    null, meaning the default; SDKs that send every field send them so (they were 400s)."""
    r = completion(n=None, stream=None, echo=None, stream_options=None)
    assert (r.n, r.stream, r.echo, r.sampling_params().n) == (1, False, False, 1)
    c = chat(n=None, logprobs=None, stream=True, stream_options={"include_usage": None})
    assert (c.n, c.logprobs, c.include_usage) == (1, False, True)  # null: the default, True
    assert c.sampling_params().logprobs is None
    assert chat(stream=True, stream_options={}).include_usage  # vLLM's default, given the object
    assert not chat(stream=True).include_usage
    with pytest.raises(ValidationError):  # a field the spec does not let be null still is not
        completion(ignore_eos=None)


def test_every_sampling_field_reaches_sampling_params():
    p = completion(
        n=3,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        max_tokens=9,
        min_tokens=2,
        stop="END",
        stop_token_ids=[5],
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=3,
    ).sampling_params()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (3, 0.5, 0.9, 40, 0.05, 7)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids, p.ignore_eos) == (
        9,
        2,
        ["END"],
        [5],
        True,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logprobs) == (
        0.5,
        -0.5,
        1.2,
        3,
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"n": 0},
        {"logit_bias": {"5": 500.0}},
        {"logit_bias": {"x": 1.0}},
        {"best_of": 3},
        {"stop": [""]},
        {"logprobs": -2},  # past 20 is the engine's to refuse (--max-logprobs)
    ],
)
def test_out_of_range_values_are_config_errors(fields):
    with pytest.raises(ConfigError):
        completion(**fields).sampling_params()


def test_chat_limits_and_logprobs():
    assert chat(max_tokens=5).sampling_params().max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).sampling_params().max_tokens == 7
    assert chat(logprobs=True).sampling_params().logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).sampling_params().logprobs == 4
    assert chat().sampling_params().logprobs is None
    with pytest.raises(ConfigError):
        chat(top_logprobs=2).sampling_params()


def test_chat_messages_accept_text_parts_and_reject_others():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert [m.as_template_input() for m in req.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": ""},
    ]
    for bad in (
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": bad})


def test_unknown_fields_are_dropped_and_named():
    assert completion(frobnicate=1, user="me").prompt == ["hi"]  # no context: dropped only
    context: dict = {}
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]},
                {
                    "role": "assistant",
                    "content": "b",
                    "refusal": "c",
                    "tool_calls": [
                        {
                            "id": "1",
                            "index": 0,
                            "function": {"name": "f", "arguments": "{}", "x": 1},
                        }
                    ],
                },
            ],
            "frobnicate": 1,
            "user": "me",  # a field: read (and answered), not dropped
            "use_beam_search": False,  # vLLM's, at its "not used" value: understood
            "stream": True,
            "stream_options": {"include_usage": True, "chunk_size": 4},
        },
        context=context,
    )
    assert req.messages[0].content == [{"type": "text", "text": "a"}] and req.include_usage
    assert context[IGNORED] == {
        "frobnicate",
        "messages[].content[].cache_control",
        "messages[].refusal",
        "messages[].tool_calls[].index",
        "messages[].tool_calls[].function.x",
        "stream_options.chunk_size",
    }
    context = {}
    CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 3}, context=context)
    assert IGNORED not in context


def test_stream_options_need_a_stream():
    with pytest.raises(ParamError, match="only allowed when stream is true") as e:
        completion(stream_options={"include_usage": True}).sampling_params()
    assert e.value.param == "stream_options"
    with pytest.raises(ParamError, match="only allowed when stream is true"):
        chat(stream_options={"include_usage": True}).sampling_params()
    completion(stream_options={"include_usage": False}).sampling_params()  # asks for nothing


def test_include_usage():
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True).include_usage


def test_chat_delta_leaves_out_what_it_does_not_carry():
    assert ChatDelta().model_dump() == {}
    assert ChatDelta(role="assistant", content="").model_dump() == {
        "role": "assistant",
        "content": "",
    }
    assert ChatDelta(content="x").model_dump_json() == '{"content":"x"}'

"""Validation at the edge: each class of bad value is a 400 naming the field, offline and over HTTP.

Offline, `SamplingParams` (and `LLM.generate`, which re-checks) raises
ParamError with `.param`; over HTTP a real server answers OpenAI-shaped 400s
with `param` set, a bad request never disturbs one already streaming, and
values that mean something (a temperature of 1e-38, seed -1, top_k 0) are
normalised the way vLLM does, not rejected.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from server_process import TINY_SERVER, ServerProcess, serve_error

from pagedkv.config import ConfigError
from pagedkv.engine.llm import LLM
from pagedkv.engine.request import (
    GREEDY_BELOW,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    TOP_P_FLOOR,
    ParamError,
    SamplingParams,
)
from pagedkv.server.middleware import MAX_BODY_BYTES
from pagedkv.server.validation import MAX_MESSAGES, MAX_PROMPTS

HUGE = 10**20  # the reported top_k: past int64
VOCAB = 512  # tests/tiny_model.py
CHAT = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- offline: SamplingParams and LLM


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", True),
        ("n", 2**63),
        ("n", 1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "1"),
        ("temperature", 10**400),
        pytest.param("top_k", 10**5000, id="top_k-5000-digits"),
        ("seed", [1]),
        ("top_p", 0.0),
        ("top_p", float("nan")),
        ("top_p", 1.5),
        ("top_k", HUGE),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", None),
        ("min_p", float("nan")),
        ("min_p", 1.1),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", "7"),
        ("max_tokens", 0),
        ("max_tokens", 2**63),
        ("min_tokens", -1),
        ("min_tokens", 2**64),
        ("presence_penalty", float("inf")),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("logprobs", -2),  # -1 asks for the whole vocabulary; the engine caps the count
        ("prompt_logprobs", -2),
        ("logprobs", HUGE),
        ("stop", [""]),
        ("stop", ["\ud800"]),
        ("stop", ["x" * 257]),
        ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
        ("stop", 5),
        ("stop", [5]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**63]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", "1"),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
    ],
)
def test_bad_sampling_params_are_rejected_naming_the_field(field, value):
    with pytest.raises(ParamError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ParamError) as err:
        SamplingParams(max_tokens=2, min_tokens=3)
    assert err.value.param == "min_tokens"


def test_values_that_mean_something_are_normalised_like_vllm():
    tiny = SamplingParams(temperature=1e-38, top_p=0.5, top_k=3, min_p=0.2)
    assert (tiny.temperature, tiny.top_p, tiny.top_k, tiny.min_p) == (0.0, 1.0, -1, 0.0)
    assert tiny.greedy
    assert SamplingParams(temperature=GREEDY_BELOW / 2).greedy
    assert SamplingParams(temperature=GREEDY_BELOW).temperature == MIN_TEMPERATURE  # no overflow
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_p=1e-300).top_p == TOP_P_FLOOR
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop_token_ids=[5, 5, 3]).stop_token_ids == [5, 3]


def test_validate_rechecks_fields_changed_after_construction():
    p = SamplingParams(temperature=0.7)
    p.top_k = HUGE
    with pytest.raises(ParamError, match="top_k"):
        p.validate()
    p.top_k, p.temperature = 5, 1e-38
    p.validate()
    assert p.greedy and p.top_k == -1
    with pytest.raises(ParamError) as err:
        SamplingParams(stop_token_ids=[VOCAB]).validate(vocab_size=VOCAB)
    assert err.value.param == "stop_token_ids"


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir, dtype="float32", num_gpu_blocks_override=64)


def assert_engine_idle(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().used == 0 and not llm.engine.has_unfinished()


def test_offline_tiny_temperature_is_greedy(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tiny = SamplingParams(temperature=1e-38, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "Paged attention"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, tiny, use_tqdm=False)] == expected
    assert len(set(expected[0])) > 1  # not one token repeated (what NaN probabilities gave)


@pytest.mark.parametrize(
    "prompt, change, param",
    [
        ("hi", {"top_k": HUGE}, "top_k"),
        ("hi", {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ("hi", {"logprobs": 21}, "logprobs"),  # past max_logprobs (20 by default)
        ("hi", {"prompt_logprobs": -1}, "prompt_logprobs"),  # the vocabulary, past 20
        ([VOCAB], {}, "prompt"),
        ([-1], {}, "prompt"),
        ([True], {}, "prompt"),
        ("a\ud800", {}, "prompt"),
        (5, {}, "prompt"),
        pytest.param([10**5000], {}, "prompt", id="token-id-of-5000-digits"),
    ],
)
def test_offline_generate_rejects_before_any_work(llm, prompt, change, param):
    params = SamplingParams(max_tokens=4)
    for field, value in change.items():  # after construction, as a caller might
        setattr(params, field, value)
    with pytest.raises(ParamError) as err:
        llm.generate(["fine", prompt], params, use_tqdm=False)
    assert err.value.param == param
    assert_engine_idle(llm)


def test_max_logprobs_sets_the_cap_and_minus_one_lifts_it(tiny_model_dir):
    """As vLLM's max_logprobs: -1 there lets a request's -1 ask for every token of the
    vocabulary."""
    llm = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks_override=64, max_logprobs=-1)
    params = SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1, temperature=0)
    (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert [len(step) for step in out.outputs[0].logprobs] == [VOCAB, VOCAB]
    assert [len(p.top) for p in out.prompt_logprobs[1:]] == [VOCAB, VOCAB]
    assert_engine_idle(llm)
    with pytest.raises(ConfigError, match="--max-logprobs must be an integer >= -1"):
        LLM(tiny_model_dir, max_logprobs=-2)


def test_max_logprobs_over_http(tiny_model_dir):
    with ServerProcess(tiny_model_dir, *TINY_SERVER, "--max-logprobs", "25") as srv:
        top = {"logprobs": True, "max_tokens": 1, "messages": CHAT, "model": "tiny"}
        r = post(srv, "/v1/chat/completions", {**top, "top_logprobs": 25})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
        error = assert_400(
            post(srv, "/v1/chat/completions", {**top, "top_logprobs": 26}), "top_logprobs"
        )
        assert "--max-logprobs 25" in error["message"]
    lines = serve_error("--model", tiny_model_dir, "--max-logprobs", "-5")
    assert len(lines) == 1 and "--max-logprobs must be an integer >= -1" in lines[0], lines


def test_offline_chat_rejects_a_lone_surrogate(llm):
    with pytest.raises(ParamError) as err:
        llm.chat(
            [{"role": "user", "content": "\udfff"}], SamplingParams(max_tokens=2), use_tqdm=False
        )
    assert err.value.param == "prompt"
    assert_engine_idle(llm)


# ---------------------------------------------------------------- over HTTP, against a real server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        "--dtype",
        "float32",
        "--num-gpu-blocks-override",
        "128",
        "--served-model-name",
        "tiny",
    ) as srv:
        yield srv
        assert srv.http.get("/health").status_code == 200
        assert srv.wait_idle()["used"] == 0
        assert "Traceback" not in srv.output()


def post(srv: ServerProcess, path: str, body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return srv.http.post(path, content=raw, headers={"Content-Type": "application/json"})


def assert_400(response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    return error


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    "body, param",
    [
        # overflow: integers past int64
        (completion(top_k=HUGE, temperature=1), "top_k"),
        (completion(seed=2**63), "seed"),
        (completion(seed=-(2**63) - 1), "seed"),
        (completion(max_tokens=HUGE), "max_tokens"),
        (completion(n=HUGE), "n"),
        (completion(logprobs=HUGE), "logprobs"),
        (completion(min_tokens=HUGE), "min_tokens"),
        (completion(best_of=HUGE), "best_of"),
        (completion(stop_token_ids=[HUGE]), "stop_token_ids.0"),
        (chat(top_logprobs=HUGE, logprobs=True), "top_logprobs"),
        (chat(max_completion_tokens=HUGE), "max_completion_tokens"),
        # ranges (SamplingParams.validate), named as the request spelled them
        (completion(temperature=2.5), "temperature"),
        (completion(top_p=0), "top_p"),
        (completion(top_k=-2), "top_k"),
        (completion(min_p=1.5), "min_p"),
        (completion(presence_penalty=3), "presence_penalty"),
        (completion(repetition_penalty=1e-300), "repetition_penalty"),
        (completion(logprobs=21), "logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(max_completion_tokens=0), "max_completion_tokens"),
        (chat(max_completion_tokens=5000), "max_completion_tokens"),  # past max_model_len
        (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),  # the vocabulary, past 20
        (completion(prompt_logprobs=-1), "prompt_logprobs"),
        (completion(max_tokens=5000), "max_tokens"),
        (completion(n=1000), "n"),
        (completion(echo=True, logprobs=1, stream=True), "echo"),
        (completion(suffix="x"), "suffix"),
        (completion(logit_bias={"5": 101}), "logit_bias"),
        (completion(logit_bias={"-1": 1}), "logit_bias"),
        (completion(logit_bias={str(VOCAB): 1}), "logit_bias"),
        (completion(allowed_token_ids=[]), "allowed_token_ids"),
        (completion(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
        (completion(bad_words=[""]), "bad_words"),
        (completion(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (completion(prompt_logprobs=21), "prompt_logprobs"),
        (completion(best_of=2), "best_of"),
        (chat(top_logprobs=2), "top_logprobs"),
        # token ids: negative, outside the vocabulary
        (completion(prompt=[-1]), "prompt"),
        (completion(prompt=[VOCAB]), "prompt"),
        (completion(prompt=[[1], [HUGE]]), "prompt"),
        (completion(stop_token_ids=[-5]), "stop_token_ids.0"),
        (completion(stop_token_ids=[VOCAB]), "stop_token_ids"),
        # non-finite floats (1e400 reads as inf)
        (completion(temperature=float("inf")), None),
        (completion(top_p=float("nan")), None),
        (completion(presence_penalty=float("-inf")), None),
        # lone surrogates in every kind of string
        (completion(prompt="a\ud800b"), "prompt"),
        (completion(prompt=["ok", "\udfff"]), "prompt"),
        (completion(stop="\ud800"), "stop"),
        (completion(stop=["ok", "\ud800"]), "stop"),
        (completion(model="\ud800"), "model"),
        (completion(user="\ud800"), "user"),
        (completion(suffix="\ud800"), "suffix"),
        (chat(messages=[{"role": "user", "content": "\ud800"}]), "messages.0.content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
            "messages.0.content",
        ),
        (chat(messages=[{"role": "user", "content": "hi", "name": "\ud800"}]), "messages.0.name"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}]),
            "tools.0.function.description",
        ),
        # a digit Python's isdigit() knows and int() does not
        (completion(logit_bias={"\u00b2": 1}), "logit_bias"),
        # a union's member tags stay out of the parameter's name
        (chat(tool_choice="bogus"), "tool_choice"),
        # list sizes
        (completion(prompt=["hi"] * (MAX_PROMPTS + 1)), "prompt"),
        (chat(messages=CHAT * (MAX_MESSAGES + 1)), "messages"),
        (completion(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
        (completion(model="m" * 1000), "model"),
        # types
        (completion(top_k=1.5), "top_k"),
        (completion(temperature="1"), "temperature"),
        (completion(n=True), "n"),
    ],
)
def test_bad_values_are_400s_naming_the_param(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = assert_400(post(server, path, body), param)
    if param is None:
        assert "not valid JSON" in error["message"]
    if param and error["message"].split("=")[0].isidentifier():  # "field=value ...": as sent
        assert error["message"].startswith(f"{param}="), error


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"prompt": "hi", "temperature": NaN}', None),
        (b'{"prompt": "hi", "temperature": Infinity}', None),
        (b'{"prompt": "hi", "top_p": -Infinity}', None),
        (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
        (
            b'{"prompt": "hi", "top_k": 1' + b"0" * 5000 + b"}",
            None,
        ),  # past Python's 4300-digit limit
        (b"[" * 100_000, None),
        (b'{"prompt": "\xff\xfe"}', None),
        (b'{"prompt": "\xed\xa0\x80"}', None),  # a surrogate encoded in UTF-8: not valid UTF-8
        (b'"just a string"', None),
        (b"", None),
        (b'{"prompt": "hi"', None),
    ],
)
def test_bodies_that_are_not_strict_json_objects_are_400s(server, raw, param):
    assert_400(post(server, "/v1/completions", raw), param)


def test_a_body_over_the_size_limit_is_a_413(server):
    response = post(server, "/v1/completions", completion(prompt="x" * MAX_BODY_BYTES))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "query, param",
    [
        ("seed=" + "9" * 30, "seed"),
        ("bytes_per_token=" + "9" * 30, "bytes_per_token"),
        ("max_model_len=0", "max_model_len"),
        ("requests=100001", "requests"),
        ("kv_memory=" + "9" * 40, "kv_memory"),
        ("kv_memory=nan", "kv_memory"),
        ("kv_memory=0", "kv_memory"),
        ("policies=paged:0", "policies"),
        ("policies=" + "paged:1," * 40, "policies"),
        ("max_output=x", "max_output"),
    ],
)
def test_bad_simulate_query_params_are_400s(server, query, param):
    assert_400(
        server.http.get(
            f"/v1/simulate?{query}&requests=5"
            if "requests" not in query
            else f"/v1/simulate?{query}"
        ),
        param,
    )


def test_the_openai_client_sees_the_param(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, temperature=1, extra_body={"top_k": HUGE}
        )
    assert err.value.param == "top_k" and err.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, seed=2**64)
    assert err.value.param == "seed"


def test_a_huge_top_k_does_not_disturb_a_running_stream(server):
    """The reported case: the bad request crashed the engine step, failing every request in it."""
    args = dict(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=48,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    alone = server.openai().completions.create(**args).choices[0].text

    async def scenario() -> tuple[str, str | None]:
        client = server.async_openai()
        stream = await client.completions.create(stream=True, **args)
        text, finish, chunks = "", None, 0
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            chunks += 1
            if chunks == 2:  # mid-stream: the engine is busy with it
                with pytest.raises(openai.BadRequestError) as err:
                    await client.completions.create(
                        model="tiny",
                        prompt="hi",
                        max_tokens=2,
                        temperature=1,
                        extra_body={"top_k": HUGE},
                    )
                assert err.value.param == "top_k"
        return text, finish

    text, finish = asyncio.run(scenario())
    assert (text, finish) == (alone, "length")
    assert server.wait_idle()["used"] == 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_tiny_temperature_over_http_is_greedy(server, endpoint):
    client = server.openai()

    def run(temperature: float) -> str:
        args = dict(
            model="tiny", max_tokens=12, temperature=temperature, extra_body={"ignore_eos": True}
        )
        if endpoint == "chat":
            return client.chat.completions.create(messages=CHAT, **args).choices[0].message.content
        return client.completions.create(prompt="hi", **args).choices[0].text

    assert run(1e-38) == run(0.0)


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": -1},
        {"top_k": 0},
        {"top_k": -1},
        {"top_k": 2**63 - 1},
        {"top_p": 1e-300},
        {"temperature": 1e-3},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"stop": ["é", "東京"]},
        {"prompt": "\U0001f600 emoji"},
    ],
)
def test_values_at_the_edges_of_the_valid_range_are_served(server, fields):
    response = post(server, "/v1/completions", completion(**{"temperature": 1, **fields}))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1

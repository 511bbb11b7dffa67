"""The OpenAI-compatible API against a real `pagedkv serve` process, with the official `openai` client.

One server (tiny random model, small blocks) serves the whole module; after
every test no block may still be held, so a leak in any path fails the test
that caused it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_process import ServerProcess

from pagedkv.model.tokenizer import Tokenizer
from pagedkv.sim.simulate import simulate
from pagedkv.sim.trace import generate_trace

BLOCK = 4
LONG_PROMPT = "Paged attention keeps the KV cache in blocks. " * 6


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerProcess(
        tiny_model_dir,
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks-override",
        "256",
        "--max-model-len",
        "1024",
        "--served-model-name",
        "tiny",
    ) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_leaks(server):
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_model_dir)


EXTRA = {
    "ignore_eos",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "stop_token_ids",
}  # beyond OpenAI's


def complete(client, prompt="Hello world", **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    extra = {k: kw.pop(k) for k in EXTRA & set(kw)}
    return client.completions.create(model="tiny", prompt=prompt, extra_body=extra or None, **kw)


# ---------------------------------------------------------------- basics


def test_health_and_models(server, client):
    assert server.http.get("/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == 1024
    # OpenAI's retrieve: the same card; an unknown name is the 404 generation endpoints give
    card = client.models.retrieve("tiny").model_dump(exclude={"created"})
    assert card == models[0].model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other/model")


def test_headers_past_vllms_default_count_are_a_431(server):
    """--h11-max-header-count's default, 256 as in vLLM, holds without the flag."""
    assert server.http.get("/health", headers={f"x-{i}": "1" for i in range(200)}).is_success
    r = server.http.get("/health", headers={f"x-{i}": "1" for i in range(300)})
    assert r.status_code == 431 and "the limit is 256" in r.json()["error"]["message"]


def test_the_start_up_log_says_what_was_loaded_and_the_pool(server):
    """The load's own lines (weights, the KV pool's size and max_model_len) reach the log: they
    were logged before uvicorn set logging up, so they went nowhere."""
    kv = server.kv()
    log = server.output()
    assert re.search(r"INFO: +loaded \S+ in [\d.]+s: weights [\d.]+ \w+", log)
    assert f"KV pool: {kv['num_blocks']} blocks of {kv['block_size']} tokens" in log
    assert "max_model_len 1024" in log


def test_an_ipv6_host_is_served_and_logged_in_brackets(tiny_model_dir):
    """--host ::1: the start-up line gives a URL a browser or client can take (http://[::1]:PORT,
    not http://::1:PORT), and that URL answers."""
    with ServerProcess(tiny_model_dir, "--host", "::1", "--num-gpu-blocks-override", "64") as srv:
        assert srv.url.startswith("http://[::1]:")
        assert srv.http.get("/health").status_code == 200
        assert f"OpenAI API at {srv.url}/v1, dashboard at {srv.url}/" in srv.output()


def test_completion_string_and_token_ids_agree(client, tokenizer):
    by_text = complete(client, "Hello world")
    ids = tokenizer.encode("Hello world")
    by_ids = complete(client, ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.choices[0].finish_reason == "length"
    u = by_text.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 8, len(ids) + 8)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")


def test_streamed_completion_equals_the_plain_one(client):
    plain = complete(client, "The quick brown fox", max_tokens=12)
    chunks = list(
        complete(
            client,
            "The quick brown fox",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_sse_wire_format_ends_with_done(server):
    with server.http.stream(
        "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_chat_streamed_and_not(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # max_completion_tokens is the newer name of max_tokens
    short = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=3, temperature=0
    )
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_chat_stream_ends_with_the_stop_reason(server):
    """The last chunk says what stopped the answer, as the full response does."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "temperature": 0}
    ids = server.http.post(
        "/v1/chat/completions",
        json={**body, "max_tokens": 6, "logprobs": True, "return_tokens_as_token_ids": True},
    ).json()["choices"][0]["logprobs"]["content"]
    stop = int(ids[3]["token"].removeprefix("token_id:"))
    body |= {"max_tokens": 20, "stop_token_ids": [stop]}
    plain = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["stop_reason"] == stop
    with server.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(e[6:]) for e in r.iter_lines() if e.startswith("data: {")]
    last = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in last] == [("stop", stop)]


def test_chat_applies_the_template(client, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, temperature=0
    )
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_n_samples_and_prompt_batches_are_indexed(client):
    out = complete(client, "Hello", n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 12
    batch = complete(client, ["Hello", "The fox"], n=2, max_tokens=4)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    # greedy: both samples of one prompt agree, and each prompt answers as it does alone
    assert (
        batch.choices[0].text
        == batch.choices[1].text
        == complete(client, "Hello", max_tokens=4).choices[0].text
    )
    assert batch.choices[2].text == complete(client, "The fox", max_tokens=4).choices[0].text
    streamed = list(complete(client, ["Hello", "The fox"], n=2, max_tokens=4, stream=True))
    for i in range(4):
        assert (
            "".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
            == batch.choices[i].text
        )


def test_seed_reproduces_a_sample(client):
    a = complete(client, "Memory is", temperature=1.0, seed=1234, max_tokens=10)
    b = complete(client, "Memory is", temperature=1.0, seed=1234, max_tokens=10)
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_ends_the_answer(client):
    full = complete(client, "Hello world", max_tokens=24, ignore_eos=True).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    out = complete(client, "Hello world", max_tokens=24, ignore_eos=True, stop=[stop]).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


def test_logprobs_completions_and_chat(client):
    out = complete(client, "Hello", max_tokens=5, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob >= max(a.logprob for a in t.top_logprobs) - 1e-4 for t in content)


def test_cached_tokens_are_reported(server, client):
    first = complete(client, LONG_PROMPT, max_tokens=2)
    second = complete(client, LONG_PROMPT, max_tokens=2)
    prompt = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert (
        cached % BLOCK == 0 and prompt - BLOCK <= cached < prompt
    )  # all full blocks but the last token
    snap = server.wait_idle()
    assert [
        b for b in snap["blocks"] if b["ref_count"] != 0
    ] == []  # a prefix hit must not double-free


# ---------------------------------------------------------------- metrics, /v1/kv, /v1/simulate


def test_metrics_name_filter_returns_only_those_series(server):
    """GET /metrics?name[]=a&name[]=b answers those series only, as vLLM's /metrics does."""
    text = server.http.get("/metrics").text
    assert "pagedkv:num_requests_waiting" in text
    wanted = ["pagedkv:num_requests_running", "pagedkv:generation_tokens_total"]
    reply = server.http.get("/metrics", params=[("name[]", n) for n in wanted])
    assert reply.status_code == 200
    samples = {
        line.split("{")[0].split()[0]
        for line in reply.text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples == set(wanted)


PROMETHEUS_ACCEPT = (  # what Prometheus sends when it scrapes
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def test_metrics_speak_openmetrics_and_gzip_when_asked(server):
    """A Prometheus scrape gets OpenMetrics, gzipped, as prometheus_client's /metrics app (vLLM's)
    answers it (Prometheus 2's Accept header, which leaves the escaping to the server); a client
    asking for neither gets the plain text format."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    scrape = server.http.get(
        "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"}
    )
    assert scrape.headers["content-type"].startswith("application/openmetrics-text")
    assert scrape.headers["content-encoding"] == "gzip"  # (httpx has inflated .text)
    assert scrape.text.endswith("# EOF\n")
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}  # raises if bad
    # every sample under its own family's name (prometheus_client alone writes `pagedkv_...`)
    assert all(s.name.startswith(n) for n, f in families.items() for s in f.samples)
    assert (
        families["pagedkv:generation_tokens"].samples[0].name == "pagedkv:generation_tokens_total"
    )
    assert families["pagedkv:num_requests_running"].samples
    plain = server.http.get("/metrics", headers={"Accept": "*/*", "Accept-Encoding": "identity"})
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "content-encoding" not in plain.headers and "# EOF" not in plain.text


def test_metrics_mirror_the_engine(server, client):
    before = server.metrics()
    out = complete(client, "Counting tokens", max_tokens=6)
    after = server.metrics()
    names = [
        "kv_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "kv_cache_capacity_tokens",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
    ]
    assert all(f"pagedkv:{n}" in after for n in names), sorted(after)
    delta = {n: after[f"pagedkv:{n}"] - before.get(f"pagedkv:{n}", 0.0) for n in names}
    assert delta["generation_tokens_total"] == 6
    assert delta["prompt_tokens_total"] == out.usage.prompt_tokens
    assert delta["prefix_cache_queries_total"] >= out.usage.prompt_tokens - 1
    assert (
        delta["time_to_first_token_seconds_count"] == 1
        and delta["e2e_request_latency_seconds_count"] == 1
    )
    assert delta["inter_token_latency_seconds_count"] == 5
    assert after["pagedkv:kv_cache_capacity_tokens"] == 256 * BLOCK
    assert after["pagedkv:num_requests_running"] == 0


def test_kv_snapshot_shape(server):
    snap = server.kv()
    assert snap["num_blocks"] == len(snap["blocks"]) == 256 and snap["block_size"] == BLOCK
    assert snap["used"] == 0 and snap["free"] == 256 and snap["model"] == "tiny"
    assert {b["state"] for b in snap["blocks"]} <= {"free", "cached"}
    assert snap["cached"] == sum(b["state"] == "cached" for b in snap["blocks"]) > 0


def test_simulate_endpoint_is_the_cli_arithmetic(server):
    q = {
        "kv_memory": "1GiB",
        "bytes_per_token": 65536,
        "max_model_len": 4096,
        "max_output": 1024,
        "requests": 50,
        "seed": 3,
        "policies": "reserve-max,reserve-output,paged:16",
    }
    got = server.http.get("/v1/simulate", params=q).json()
    trace = generate_trace(50, 3, output_cap=1024)
    want = simulate(
        trace,
        kv_memory="1GiB",
        bytes_per_token=65536,
        max_model_len=4096,
        max_output=1024,
        policies="reserve-max,reserve-output,paged:16",
    ).to_dict()
    assert got == want
    assert (
        got["policies"][2]["requests_fit"]
        > got["policies"][1]["requests_fit"]
        > got["policies"][0]["requests_fit"]
    )
    bad = server.http.get("/v1/simulate", params={"policies": "paged:0"})
    assert bad.status_code == 400 and "policy" in bad.json()["error"]["message"]
    # a misspelt parameter is named, not answered with the defaults' figures
    typo = server.http.get("/v1/simulate", params={"request": 5, "kv_memory": "1GiB"})
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "request"


# ---------------------------------------------------------------- bad input

TOO_LONG = "word " * 2000
BAD_INPUTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400),  # malformed JSON
    ("/v1/completions", b'["not", "an", "object"]', 400),
    ("/v1/completions", b"\xff\xfe", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),  # wrong types
    ("/v1/completions", {"prompt": 42}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404),  # unknown model
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400),  # beyond the context
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}, 400),  # prompt > max_model_len
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.01}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400),  # n too large
    ("/v1/completions", {"prompt": [1, 2, 999999]}, 400),  # outside the vocab
    ("/v1/completions", {"prompt": [1, -1]}, 400),
    ("/v1/completions", {"prompt": ""}, 400),  # empty prompt
    ("/v1/completions", {"prompt": []}, 400),
    (
        "/v1/completions",
        {"prompt": "hi", "stream": True, "max_tokens": 0},
        400,
    ),  # before the stream
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": -1}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
        404,
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": -2, "stream": True},
        400,
    ),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    (  # this server does not trust request templates (--trust-request-chat-template)
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' * 10**9 }}"},
        400,
    ),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "x"}, 400),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"chat_template": "x"},
        },
        400,
    ),
    ("/v1/nothing-here", {}, 404),
]


@pytest.mark.parametrize("path, body, status", BAD_INPUTS)
def test_bad_input_gets_an_openai_error(server, path, body, status):
    if isinstance(body, bytes):
        r = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if "chat_template" in str(body):
        assert "--trust-request-chat-template" in err["message"]
    assert server.http.get("/health").status_code == 200


def test_wrong_method_is_405_in_the_openai_shape(server):
    r = server.http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "hi", max_tokens=0)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], top_p=2.0, stream=True
        )


def test_fields_nothing_reads_are_named_in_a_header(server, client):
    """Dropped as vLLM drops them (clients send newer OpenAI fields), but not silently."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi", "refusal": "x"}],
        max_tokens=2,
        extra_body={"frobnicate": 1, "max_token": 50, "use_beam_search": False},
    )
    assert raw.parse().usage.completion_tokens == 2  # max_token (a typo) did not count
    assert raw.headers["x-pagedkv-ignored-fields"] == (
        "frobnicate, max_token, messages[].refusal"
    )
    streamed = server.http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "stream": True, "store": True, "\n\u00e9": 1},
    )
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert streamed.headers["x-pagedkv-ignored-fields"] == "store, (+1 not shown)"
    plain = complete(client, "hi", max_tokens=2)  # nothing dropped: no header
    raw = client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
    assert "x-pagedkv-ignored-fields" not in raw.headers and plain.usage.completion_tokens == 2
    tokenized = server.http.post("/tokenize", json={"prompt": "hi", "bogus": 1})
    assert tokenized.headers["x-pagedkv-ignored-fields"] == "bogus"
    assert "request fields that pagedkv does not use were ignored: bogus" in server.output()


def test_oversized_body_is_413(server):
    body = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    r = server.http.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = server.http.post(
        "/v1/completions",
        content=iter([body[: 2**20]] * 9),
        headers={"Content-Type": "application/json"},
    )
    assert chunked.status_code == 413
    assert complete(server.openai(), "still serving", max_tokens=2).usage.completion_tokens == 2


# ---------------------------------------------------------------- clients that go away


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"prompt": LONG_PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any('"text"' in line for line in got)
        assert server.kv()["used"] > 0
    # the context manager closed the connection long before 900 tokens
    snap = server.wait_idle(timeout=10)
    assert snap["num_requests"] == 0


def test_disconnect_while_waiting_for_a_plain_answer_frees_the_request(server):
    # 900 tokens of the tiny model take about 0.3 s here: give up long before that
    body = {"prompt": LONG_PROMPT, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.05))
    before = server.metrics()["pagedkv:generation_tokens_total"]
    server.wait_idle(timeout=10)
    assert server.metrics()["pagedkv:generation_tokens_total"] - before < 900


# ---------------------------------------------------------------- API key


def test_api_key_is_required_on_v1_routes(tiny_model_dir):
    with ServerProcess(tiny_model_dir, "--num-gpu-blocks-override", "64", api_key="s3cret") as srv:
        bare = httpx.Client(base_url=srv.url)
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = bare.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers
            )
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert bare.get("/v1/kv", headers=headers).status_code == 401
        assert bare.get("/health").status_code == 200 and bare.get("/metrics").status_code == 200
        assert bare.get("/").status_code == 200  # the page asks for the key itself
        with pytest.raises(openai.AuthenticationError):
            srv.openai(api_key="wrong").models.list()
        good = srv.openai()
        assert (
            good.completions.create(
                model=good.models.list().data[0].id, prompt="hi", max_tokens=2
            ).usage.completion_tokens
            == 2
        )


@pytest.mark.slow
def test_default_model_answers_a_chat():
    """`pagedkv serve` with no --model serves SmolLM2-135M-Instruct, chat template and all."""
    with ServerProcess(None, "--kv-cache-memory", "128MiB", "--max-model-len", "2048") as srv:
        client = srv.openai()
        model = client.models.list().data[0].id
        out = client.chat.completions.create(
            model=model,
            temperature=0,
            max_tokens=24,
            messages=[
                {"role": "user", "content": "What is the capital of France? Answer in one word."}
            ],
        )
        assert "Paris" in out.choices[0].message.content
        assert out.choices[0].finish_reason in ("stop", "length")
        chunks = list(
            client.chat.completions.create(
                model=model,
                temperature=0,
                max_tokens=24,
                stream=True,
                messages=[
                    {
                        "role": "user",
                        "content": "What is the capital of France? Answer in one word.",
                    }
                ],
            )
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks)
            == out.choices[0].message.content
        )
        srv.wait_idle()


def test_every_operation_in_the_schema_has_its_own_id(server):
    """GET and POST /ping shared one operationId: a duplicate that FastAPI warns of and that
    client generators refuse."""
    schema = server.http.get("/openapi.json").json()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"ping_get", "ping_post"} <= set(ids)
    assert server.http.post("/ping").status_code == server.http.get("/ping").status_code == 200


def test_the_utility_routes_show_their_request_bodies(server):
    """/tokenize and /detokenize read their bodies by hand, so FastAPI showed none: client
    generators and the schema fuzzer saw routes that take nothing."""
    schema = server.http.get("/openapi.json").json()
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in schema["components"]["schemas"]
    fields = schema["components"]["schemas"]["TokenizeRequest"]["properties"]
    assert {"prompt", "messages", "return_token_strs"} <= set(fields)


TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}


def NAMED(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


BAD_FIELDS = [  # (route, fields added to a valid body, the field the 400 must name)
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tools": [TOOL]}, "tool_choice"),  # "auto" needs the server's flag
    ("chat/completions", {"tools": [TOOL], "tool_choice": NAMED("other")}, "tool_choice"),
    (
        "chat/completions",
        {"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (
        "chat/completions",
        {
            "tools": [{**TOOL, "function": {**TOOL["function"], "parameters": {"properties": 3}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    ("chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat/completions", {"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs"),
    (
        "chat/completions",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                },
            ]
        },
        "messages",
    ),
    ("completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("completions", {"guided_json": {}, "guided_regex": "a+"}, "guided_regex"),
    (
        "completions",
        {"structured_outputs": {"backend": "outlines", "regex": "a"}},
        "structured_outputs",
    ),
    (
        "completions",
        {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize(("route", "fields", "param"), BAD_FIELDS)
def test_a_refused_field_is_named_in_param(server, route, fields, param):
    """OpenAI's SDKs show `error.param`: these 400s named their field only in the message."""
    body = {"model": "tiny", "max_tokens": 2}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]}
        if route.startswith("chat")
        else {"prompt": "hi"}
    )
    r = server.http.post(f"/v1/{route}", json=body | fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_x_request_id_header_names_the_answer(server):
    """As vLLM: the header's value is the answer's id; without --enable-request-id-headers the
    reply does not repeat it."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "request_id": "from-body"}
    r = server.http.post("/v1/completions", json=body, headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == "cmpl-from-header" and "x-request-id" not in r.headers
    assert server.http.post("/v1/completions", json=body).json()["id"] == "cmpl-from-body"


def test_a_cache_salt_keeps_a_tenant_s_prefix_to_itself(server, client):
    """vLLM's cache_salt: only requests with the same salt are served each other's cached blocks."""
    prompt = "Salted prefixes stay with their tenant. " * 4

    def cached(**extra) -> int:
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, extra_body=extra or None
        )
        return r.usage.prompt_tokens_details.cached_tokens

    first = cached(cache_salt="tenant-a")
    assert first == 0 and cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=1,
        extra_body={"cache_salt": "tenant-c"},
    )
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    for bad in ("", 5):
        r = server.http.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "cache_salt": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_load_counts_the_generation_requests_in_flight(server):
    """vLLM's GET /load: from a request's arrival (here its body is still on its way) to its
    answer's last byte."""
    assert server.http.get("/load").json() == {"server_load": 0}
    release = threading.Event()

    def body():
        yield b'{"model": "tiny", "prompt": "Hello", '
        release.wait(60)
        yield b'"max_tokens": 2}'

    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(server.http.post, "/v1/completions", content=body())
        deadline = time.monotonic() + 60
        while server.http.get("/load").json()["server_load"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.http.get("/load").json() == {"server_load": 1}
        release.set()
        assert sent.result().status_code == 200
    assert server.http.get("/load").json() == {"server_load": 0}


def test_tool_choice_none_still_shows_the_tools(server, client):
    """As vLLM by default: "none" keeps the model from calling a tool, not from seeing them."""

    def prompt_tokens(**tools) -> int:
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, **tools
        )
        return answer.usage.prompt_tokens

    assert prompt_tokens(tools=[TOOL], tool_choice="none") > prompt_tokens()

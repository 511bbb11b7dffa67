"""One request's failure ends that request alone; a failure the engine cannot pin on one request
stops it loudly (errors to every client, /health 503, exit code 1), never silently.

Faults are injected with `pagedkv.engine.faults` (a request whose prompt holds a marker raises at a
chosen stage), and every other request is compared with a clean run of the same schedule.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import ServerProcess

from pagedkv.config import EngineConfig
from pagedkv.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from pagedkv.engine.faults import FaultInjector
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request import SamplingParams

SHARED = "Paged attention keeps the KV cache in blocks. Hello world! Serving a model means holding"
BAD = SHARED + " BOOM the quick brown fox jumps over the lazy dog"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
SAMPLED = SamplingParams(
    n=2,
    temperature=0.9,
    top_p=0.9,
    seed=7,
    max_tokens=12,
    ignore_eos=True,
    repetition_penalty=1.3,
    frequency_penalty=0.5,
    logprobs=1,
)
STOPPED = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=["o"])

# (request id, prompt, params, step at which it is added)
SCHEDULE = [
    ("early", "The quick brown fox", GREEDY, 0),
    ("bad", BAD, GREEDY, 2),  # joins a running batch
    ("sibling", SHARED + " each request's cache while it grows", GREEDY, 2),  # bad's prefix
    ("forked", "Memory is cut into fixed-size blocks", SAMPLED, 2),
    ("stopped", "Hello world! Serving", STOPPED, 2),
]
STAGES = ["forward", "after-forward", "sample", "detokenize"]


def make_engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_options(
            model=tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks_override=256
        )
    )


def run(engine: LLMEngine, schedule=SCHEDULE) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    step, last = 0, max(at for *_, at in schedule)
    while step <= last or engine.has_unfinished():
        for rid, prompt, params, at in schedule:
            if at == step:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return finals


def assert_no_leak(engine: LLMEngine) -> None:
    engine.kv.check_integrity()
    stats = engine.kv.stats()
    assert stats.free == stats.num_blocks, f"{stats.num_blocks - stats.free} blocks still held"
    assert stats.num_requests == 0, "the KV manager still holds a block table"
    assert not engine.scheduler.has_unfinished() and not engine.groups


def comparable(out: RequestOutput) -> list[tuple]:
    """Everything but the logprob values, which move in the last float bits with the batch's makeup
    (the failed request leaves the batch), as they do when a request is aborted."""
    return [
        (
            c.index,
            c.text,
            c.token_ids,
            c.finish_reason,
            c.stop_reason,
            [(lp.token_id, sorted(lp.top)) for lp in c.logprobs or ()],
        )
        for c in out.outputs
    ]


def logprobs(out: RequestOutput) -> list[float]:
    return [
        v for c in out.outputs for lp in c.logprobs or () for v in (lp.logprob, *lp.top.values())
    ]


@pytest.fixture(scope="module")
def clean(tiny_model_dir, one_torch_thread) -> dict[str, RequestOutput]:
    engine = make_engine(tiny_model_dir)
    finals = run(engine)
    assert all(out.error is None for out in finals.values())
    assert [len(c.token_ids) for c in finals["forked"].outputs] == [12, 12]
    assert finals["stopped"].outputs[0].finish_reason == "stop"
    return finals


@pytest.mark.parametrize("after", [0, 5], ids=["first-step", "mid-decode"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_request_ends_alone(tiny_model_dir, clean, stage, after):
    engine = make_engine(tiny_model_dir)
    engine.faults = FaultInjector(stage, "BOOM", engine.tokenizer, after)
    finals = run(engine)
    assert set(finals) == set(clean)
    bad = finals.pop("bad")
    assert bad.finished and bad.error is not None and "injected" in bad.error
    assert all(c.finish_reason == "error" for c in bad.outputs)
    made = max(after, 1) if stage == "detokenize" else after  # its failing token is appended
    assert len(bad.outputs[0].token_ids) == made
    for rid, out in finals.items():
        assert out.error is None, rid
        assert comparable(out) == comparable(clean[rid]), f"{rid} changed: 'bad' failed in {stage}"
        assert logprobs(out) == pytest.approx(logprobs(clean[rid]), abs=1e-4)
    assert_no_leak(engine)

    # Whatever the failed step left half written is not served from the prefix cache later.
    engine.faults = None
    again = run(engine, [("bad-again", BAD, GREEDY, 0)])["bad-again"]
    assert again.num_cached_tokens > 0  # the shared prefix, which the sibling computed
    assert comparable(again) == comparable(clean["bad"])
    assert_no_leak(engine)


def test_every_request_failing_leaves_nothing_behind(tiny_model_dir, one_torch_thread):
    engine = make_engine(tiny_model_dir)
    engine.faults = FaultInjector("after-forward", "o", engine.tokenizer)  # all prompts have one
    finals = run(engine)
    assert all(out.error is not None for out in finals.values()) and len(finals) == len(SCHEDULE)
    assert_no_leak(engine)


# ---------------------------------------------------------------- AsyncLLM, in process


def test_async_llm_starts_itself_and_isolates(tiny_model_dir, one_torch_thread):
    async def main() -> None:
        llm = AsyncLLM(EngineConfig.from_options(model=tiny_model_dir, dtype="float32"))
        llm.engine.faults = FaultInjector("sample", "BOOM", llm.tokenizer)

        async def final(prompt: str, rid: str) -> RequestOutput:
            out = None
            async for chunk in llm.generate(prompt, GREEDY, rid):  # no start(): it starts itself
                out = chunk
            return out

        good, bad = await asyncio.wait_for(
            asyncio.gather(
                final("The quick brown fox", "good"), final(BAD, "bad"), return_exceptions=True
            ),
            120,
        )
        assert isinstance(bad, RequestFailedError) and "injected" in str(bad)
        assert isinstance(good, RequestOutput) and len(good.outputs[0].token_ids) == 12
        assert llm.error is None
        await llm.shutdown()

    asyncio.run(main())


def test_async_llm_loop_failure_reaches_every_client(tiny_model_dir, one_torch_thread):
    async def main() -> None:
        llm = AsyncLLM(EngineConfig.from_options(model=tiny_model_dir, dtype="float32"))
        await llm.start()
        llm.engine.faults = FaultInjector("step", "DIE", llm.tokenizer)
        long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

        async def consume(prompt: str, rid: str) -> None:
            async for _ in llm.generate(prompt, long, rid):
                if prompt != "DIE":
                    await asyncio.sleep(0)

        waiting = [asyncio.ensure_future(consume("The quick brown fox", f"w{i}")) for i in range(3)]
        await asyncio.sleep(0.2)
        results = await asyncio.wait_for(
            asyncio.gather(consume("DIE", "die"), *waiting, return_exceptions=True), 60
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert llm.error is not None
        with pytest.raises(EngineDeadError):  # and every later request, at once
            await anext(llm.generate("Hi", long, "late"))
        await llm.shutdown()

    asyncio.run(main())


# ---------------------------------------------------------------- over HTTP, a real server process

SERVER_ARGS = (
    "--dtype",
    "float32",
    "--block-size",
    "4",
    "--num-gpu-blocks-override",
    "512",
    "--max-model-len",
    "1024",
    "--served-model-name",
    "tiny",
)
LONG = 900  # tokens of the well-behaved requests: still running when the faulty ones fail


def body(prompt: str, stream: bool, max_tokens: int = LONG) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def post(srv: ServerProcess, payload: dict) -> tuple[int, dict, float]:
    """(status, JSON body, time the answer came)."""
    r = srv.http.post("/v1/completions", json=payload, timeout=300)
    return r.status_code, r.json(), time.monotonic()


def stream(
    srv: ServerProcess, payload: dict, started: threading.Event | None = None
) -> tuple[int, str, list[dict], float]:
    """(status, text, error events, time the stream ended); sets `started` at the first token."""
    text, errors = "", []
    with (
        httpx.Client(base_url=srv.url, timeout=300) as http,
        http.stream("POST", "/v1/completions", json=payload) as r,
    ):
        if r.status_code != 200:
            return r.status_code, "", [json.loads(r.read())], time.monotonic()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event)
            else:
                text += event["choices"][0]["text"]
                if started is not None and text:
                    started.set()
    return 200, text, errors, time.monotonic()


def assert_openai_error(payload: dict, status: int) -> None:
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "server_error" and err["message"]
    assert (status, err["code"]) in {(500, "request_failed"), (503, "service_unavailable")}


def test_http_a_failing_request_ends_alone(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PAGEDKV_INJECT_FAULT", "sample:BOOM:5")  # fail at the 6th token
    with ServerProcess(tiny_model_dir, *SERVER_ARGS) as srv, ThreadPoolExecutor(4) as pool:
        good_stream = body("The quick brown fox", True)
        good_json = body("Hello world! Serving", False)
        clean_stream, clean_json = stream(srv, good_stream)[1], post(srv, good_json)[1]
        srv.wait_idle()

        started = threading.Event()
        running_stream = pool.submit(stream, srv, good_stream, started)
        assert started.wait(120)
        running_json = pool.submit(post, srv, good_json)
        bad_json = pool.submit(post, srv, body(BAD, False, 50))
        bad_stream = pool.submit(stream, srv, body("BOOM " + SHARED, True, 50))

        status, payload, bad_json_at = bad_json.result()
        assert status == 500
        assert_openai_error(payload, 500)
        assert "injected sample fault" in payload["error"]["message"]
        status, text, errors, bad_stream_at = bad_stream.result()
        assert status == 200 and text  # five tokens streamed, then the error event
        assert len(errors) == 1
        assert_openai_error(errors[0], 500)

        status, text, errors, stream_done = running_stream.result()
        assert (status, errors, text) == (200, [], clean_stream)
        status, payload, json_done = running_json.result()
        assert status == 200 and payload["choices"][0]["text"] == clean_json["choices"][0]["text"]
        assert max(bad_json_at, bad_stream_at) < min(stream_done, json_done), "no overlap"

        srv.wait_idle()  # every block back, no request left
        assert srv.http.get("/health").status_code == 200
        assert srv.proc.poll() is None
        # the two that failed count once each, as vLLM's finished_reason="error"
        errors = re.findall(
            r'^pagedkv:request_success_total\{[^}]*finished_reason="error"[^}]*\} (\S+)$',
            srv.http.get("/metrics").text,
            re.M,
        )
        assert [float(n) for n in errors] == [2.0]
        assert srv.metrics()["pagedkv:request_success_total"] == 6


def test_http_an_engine_failure_fails_everyone_and_exits(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PAGEDKV_INJECT_FAULT", "step:DIE")  # not isolated: stops the engine loop
    with ServerProcess(tiny_model_dir, *SERVER_ARGS) as srv, ThreadPoolExecutor(3) as pool:
        started = threading.Event()
        running_stream = pool.submit(stream, srv, body("The quick brown fox", True), started)
        assert started.wait(120)
        running_json = pool.submit(post, srv, body("Hello world! Serving", False))
        deadline = time.monotonic() + 60
        while len(srv.kv()["requests"]) < 2 and time.monotonic() < deadline:  # both in the engine
            time.sleep(0.01)
        status, payload, _ = post(srv, body("DIE now", False, 5))
        assert status == 503
        assert_openai_error(payload, 503)

        status, text, errors, _ = running_stream.result()
        assert status == 200 and len(errors) == 1
        assert_openai_error(errors[0], 503)
        status, payload, _ = running_json.result()
        assert status == 503
        assert_openai_error(payload, 503)

        for method, path in (("GET", "/ping"), ("HEAD", "/health"), ("GET", "/health")):
            try:  # unhealthy until it is gone, by every probe a load balancer may use
                assert srv.http.request(method, path).status_code == 503, (method, path)
            except httpx.TransportError:
                pass
        assert srv.proc.wait(60) == 1
        assert "the engine loop stopped" in srv.output()


def test_a_failing_admission_ends_alone(tiny_model_dir, clean, monkeypatch):
    """A tier lookup that raises while one request is admitted fails that request only."""
    engine = make_engine(tiny_model_dir)
    bad_hashes = engine.kv.block_hashes(engine.tokenize(BAD))
    lookup = engine.kv.lookup_prefix

    def flaky_lookup(hashes):
        if (hashes.hashes, hashes.num_tokens) == (bad_hashes.hashes, bad_hashes.num_tokens):
            raise OSError("injected: the disk tier went away")
        return lookup(hashes)

    monkeypatch.setattr(engine.kv, "lookup_prefix", flaky_lookup)
    finals = run(engine)
    bad = finals.pop("bad")
    assert bad.error is not None and "disk tier" in bad.error
    for rid, out in finals.items():
        assert comparable(out) == comparable(clean[rid]), rid
    assert_no_leak(engine)


def test_a_streamed_background_response_that_fails_says_so(tiny_model_dir, monkeypatch):
    """Failed at its first token: its stream (opened before the engine ran it, so that it names
    the Response) ends with the error, and the Response is kept failed, its blocks freed."""
    monkeypatch.setenv("PAGEDKV_INJECT_FAULT", "sample:BOOM")
    with ServerProcess(tiny_model_dir, *SERVER_ARGS) as srv:
        request = {"model": "tiny", "input": BAD, "max_output_tokens": 8, "background": True,
                   "stream": True}  # fmt: skip
        with srv.http.stream("POST", "/v1/responses", json=request) as s:
            events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
        assert [e.get("type") for e in events] == ["response.created", "response.in_progress", None]
        assert_openai_error(events[-1], 500)
        kept = srv.http.get(f"/v1/responses/{events[0]['response']['id']}").json()
        assert kept["status"] == "failed" and "injected sample fault" in kept["error"]["message"]
        assert srv.wait_idle()["used"] == 0

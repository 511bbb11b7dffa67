"""Load and lifecycle: 64 streaming clients on a pool too small for them, and SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from server_process import ServerProcess

CLIENTS = 64
MAX_TOKENS = 24
PROMPTS = [
    "The quick brown fox",
    "Memory is cut into blocks",
    "Hello world!",
    "Serving a model means",
]


async def stream_one(
    client: openai.AsyncOpenAI, model: str, prompt: str
) -> tuple[str, str | int, int]:
    """('ok', text, tokens) when the stream completes, ('rejected', status, 0) on a 429/503."""
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, usage, parts = None, None, []
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length"
        return "ok", "".join(parts), usage.completion_tokens
    except openai.APIStatusError as e:
        assert e.status_code in (429, 503), e
        assert e.body["message"]  # the OpenAI error shape (the client unwraps "error")
        return "rejected", e.status_code, 0


def test_64_streaming_clients_on_a_small_pool(tiny_model_dir):
    # 32 blocks of 4 tokens hold 128 tokens; each request grows to ~30, 16 may run: preemption must cope.
    # float32, because in bfloat16 a greedy answer may change with the batch it runs in
    with ServerProcess(
        tiny_model_dir,
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "32",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "16",
        "--max-waiting",
        "24",
    ) as srv:
        model = srv.openai().models.list().data[0].id

        async def run() -> tuple[dict[str, str], list]:
            async with srv.async_openai(timeout=120) as client:
                alone = {p: (await stream_one(client, model, p))[1] for p in PROMPTS}
                jobs = [
                    stream_one(client, model, PROMPTS[i % len(PROMPTS)]) for i in range(CLIENTS)
                ]
                return alone, await asyncio.wait_for(
                    asyncio.gather(*jobs), timeout=240
                )  # nothing hangs

        start = time.monotonic()
        alone, results = asyncio.run(run())
        elapsed = time.monotonic() - start
        done = [(i, text, tokens) for i, (kind, text, tokens) in enumerate(results) if kind == "ok"]
        rejected = [status for kind, status, _ in results if kind == "rejected"]
        assert len(done) + len(rejected) == CLIENTS
        assert done and rejected, f"{len(done)} done, {len(rejected)} rejected"
        for i, text, tokens in done:  # preemption never truncates or changes a greedy answer
            assert tokens == MAX_TOKENS and text == alone[PROMPTS[i % len(PROMPTS)]]
        srv.wait_idle(timeout=30)
        m = srv.metrics()
        assert m["pagedkv:num_preemptions_total"] > 0
        assert m["pagedkv:num_requests_running"] == m["pagedkv:num_requests_waiting"] == 0
        print(
            f"\n{len(done)} completed, {len(rejected)} rejected ({set(rejected)}), "
            f"{m['pagedkv:num_preemptions_total']:.0f} preemptions, {elapsed:.1f}s"
        )


def exited_gracefully(srv: ServerProcess, code: int) -> bool:
    """A clean stop: exit code 0 (not death by the signal, which uvicorn would raise again), after
    the lifespan ended."""
    return code == 0 and "Application shutdown complete" in srv.output()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_on_an_idle_server_exits(tiny_model_dir, sig):
    srv = ServerProcess(tiny_model_dir, "--num-gpu-blocks-override", "32")
    try:
        start = time.monotonic()
        srv.proc.send_signal(sig)
        assert exited_gracefully(srv, srv.proc.wait(timeout=30)), srv.output()
        assert time.monotonic() - start < 15
    finally:
        srv.close()


def test_sigterm_tells_a_running_stream_and_exits(tiny_model_dir):
    srv = ServerProcess(
        tiny_model_dir, "--num-gpu-blocks-override", "1024", "--shutdown-timeout", "0.1"
    )  # 2000 tokens take ~0.7 s here
    try:
        events = []
        body = {"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=srv.url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 5:
                        srv.proc.send_signal(signal.SIGTERM)
        assert exited_gracefully(srv, srv.proc.wait(timeout=30)), srv.output()
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        # the request could not finish within the grace period: it is told, not cut off
        assert (
            last["error"]["code"] == "service_unavailable"
            and "shutting down" in last["error"]["message"]
        )
        assert len(events) < 2000
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health")
    finally:
        srv.close()

"""A bounded soak of a real `pagedkv serve`: many clients with random valid parameters, some vanishing.

    python benchmarks/soak.py --requests 2000 --concurrency 16 -- --model M --max-waiting 8

starts its own server (everything after `--` goes to `pagedkv serve`; the port is
chosen by the OS) or soaks `--url`. Requests mix /v1/completions and
/v1/chat/completions, n up to 3, stop strings, logprobs, streaming; a fifth of the
streaming clients go away after the first chunks; every `--burst-every` requests
a burst of `--burst` simultaneous requests goes past `--max-waiting`. Bounded in
count and in time (`--max-seconds`). It prints (and with `--json` writes) what
came back: completed, vanished, rejected by status code, errors, the server's
resident memory at start and end, and blocks still held at the end (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

STOPS = [".", "\n", " the", ",", "!", "ing", "a"]
WORDS = "the a memory block cache token page table request prefix stream model time".split()


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    vanished: int = 0  # clients that closed their stream early, on purpose
    rejected: dict[str, int] = field(default_factory=dict)  # status code -> count (4xx by design)
    errors: list[str] = field(default_factory=list)  # 5xx, broken streams, transport errors
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None
    blocks_held_at_end: int = -1
    seconds: float = 0.0

    def summary(self) -> str:
        rss = (
            f"{self.rss_start_mib:.0f} -> {self.rss_end_mib:.0f} MiB"
            if self.rss_start_mib is not None and self.rss_end_mib is not None
            else "n/a"
        )
        return (
            f"{self.requests} requests in {self.seconds:.0f}s: {self.completed} completed, "
            f"{self.vanished} vanished mid-stream, rejected {self.rejected or {}}, "
            f"{len(self.errors)} errors; server RSS {rss}; blocks held at end: {self.blocks_held_at_end}"
        )


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(m.group(1)) / 1024 if m else None


def random_body(rng: random.Random, model: str) -> tuple[str, dict]:
    """One valid request: the endpoint and its JSON body."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(1, 24),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "temperature": rng.choice([0.0, 0.0, 0.7, 1.0, 1.3]),
        "seed": rng.randint(0, 2**31),
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.3:
        body["top_p"], body["top_k"] = rng.uniform(0.1, 1.0), rng.choice([-1, 1, 5, 40])
    if rng.random() < 0.2:
        body["presence_penalty"], body["frequency_penalty"] = rng.uniform(-1, 1), rng.uniform(-1, 1)
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["prompt"] = text
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
        return "/v1/completions", body
    body["messages"] = [{"role": "user", "content": text}]
    return "/v1/chat/completions", body


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, model: str, report: SoakReport
) -> None:
    path, body = random_body(rng, model)
    vanish = body["stream"] and rng.random() < 0.2
    report.requests += 1
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code >= 500:
                report.errors.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                return
            if r.status_code != 200:
                await r.aread()
                key = str(r.status_code)
                report.rejected[key] = report.rejected.get(key, 0) + 1
                return
            if not body["stream"]:
                data = json.loads(await r.aread())
                if len(data["choices"]) != body["n"]:
                    report.errors.append(f"{len(data['choices'])} choices for n={body['n']}")
                    return
                report.completed += 1
                return
            await read_stream(r, vanish, report)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        report.errors.append(f"{type(e).__name__}: {e}")


async def read_stream(r: httpx.Response, vanish: bool, report: SoakReport) -> None:
    """Count the stream as completed when it ends with [DONE] and no error event came before it."""
    events = 0
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            report.completed += 1
            return
        if '"error"' in line[:20]:
            report.errors.append(f"error event: {line[:200]}")
            return
        events += 1
        if vanish and events >= 2:
            report.vanished += 1
            return  # leaving the `async with` closes the connection mid-stream
    if vanish:
        report.vanished += 1  # the answer was shorter than two events: gone at the end
    else:
        report.errors.append("stream ended without [DONE]")


async def wait_idle(client: httpx.AsyncClient, timeout: float) -> int:
    """Blocks still used once the server has had `timeout` seconds to free them."""
    deadline = time.monotonic() + timeout
    while True:
        used = int((await client.get("/v1/kv")).json()["used"])
        if used == 0 or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.1)


async def soak(
    url: str,
    *,
    requests: int,
    concurrency: int,
    burst: int,
    burst_every: int,
    max_seconds: float,
    seed: int,
    pid: int | None = None,
) -> SoakReport:
    rng, report = random.Random(seed), SoakReport()
    limits = httpx.Limits(max_connections=concurrency + burst + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        report.rss_start_mib = rss_mib(pid)
        start, gate, tasks = time.monotonic(), asyncio.Semaphore(concurrency), []

        async def gated() -> None:
            async with gate:
                await one_request(client, random.Random(rng.random()), model, report)

        for i in range(requests):
            if time.monotonic() - start > max_seconds:
                break
            if burst and burst_every and i % burst_every == burst_every - 1:  # past --max-waiting
                tasks += [
                    asyncio.create_task(
                        one_request(client, random.Random(rng.random()), model, report)
                    )
                    for _ in range(burst)
                ]
            tasks.append(asyncio.create_task(gated()))
            await asyncio.sleep(0)
            if len(tasks) > 4 * concurrency + burst:  # keep the pending set bounded
                done = [t for t in tasks if t.done()]
                tasks = [t for t in tasks if not t.done()]
                if not done:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*tasks)
        report.seconds = time.monotonic() - start
        report.blocks_held_at_end = await wait_idle(client, timeout=30)
        report.rss_end_mib = rss_mib(pid)
    return report


class SpawnedServer:
    """`pagedkv serve --port 0 ARGS` in a subprocess; the URL is read from uvicorn's start-up line."""

    def __init__(self, serve_args: list[str], timeout: float = 180.0) -> None:
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="pagedkv-soak-", suffix=".log", delete=False
        )
        repo = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": repo, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", "0", *serve_args]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=repo
        )
        deadline = time.monotonic() + timeout
        while not (
            m := re.search(
                r"Uvicorn running on (http://[\d.]+:\d+)", Path(self.log.name).read_text()
            )
        ):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = Path(self.log.name).read_text()
                self.close()
                raise RuntimeError(f"server did not start:\n{log}")
            time.sleep(0.1)
        self.url = m.group(1)

    def close(self) -> bool:
        """SIGTERM; True when the server shut down gracefully (uvicorn re-raises the signal after)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log = Path(self.log.name).read_text()
        self.log.close()
        os.unlink(self.log.name)
        return (
            self.proc.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in log
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="soak this server instead of starting one")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--burst", type=int, default=24, help="simultaneous requests in a burst")
    p.add_argument("--burst-every", type=int, default=200)
    p.add_argument("--max-seconds", type=float, default=1800)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    server = None if args.url else SpawnedServer(serve_args)
    try:
        report = asyncio.run(
            soak(
                args.url or server.url,
                requests=args.requests,
                concurrency=args.concurrency,
                burst=args.burst,
                burst_every=args.burst_every,
                max_seconds=args.max_seconds,
                seed=args.seed,
                pid=server.proc.pid if server else None,
            )
        )
    finally:
        graceful = server.close() if server else True
    print(report.summary())
    for e in Counter(report.errors).most_common(5):
        print("  error:", *e)
    if args.json:
        Path(args.json).write_text(
            json.dumps({**asdict(report), "server_exited_gracefully": graceful}, indent=1)
        )
    return 0 if not report.errors and report.blocks_held_at_end == 0 and graceful else 1


if __name__ == "__main__":
    sys.exit(main())

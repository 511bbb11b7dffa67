"""Prefix-aware vs round-robin on real replicas: `pagedkv serve --data-parallel-size 2 --routing X`.

    python benchmarks/replica_routing.py --tenants 6 --users 5 -- --kv-cache-memory 96MiB

For each routing, starts the server (everything after `--` goes to `pagedkv serve`), sends
the same multi-tenant workload (each tenant a long system prompt, users in random order,
`--concurrency` at a time), and reads the replicas' summed /metrics: prompt tokens looked up,
found in the prefix cache, and computed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TOPICS = [
    "billing",
    "the weather",
    "a cooking recipe",
    "train timetables",
    "gardening",
    "chess openings",
    "bird songs",
    "tax forms",
    "car repairs",
    "poetry",
]


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(tenant)
    vocab = (
        "the a of block cache memory page table token request answer model user help polite short"
    ).split()
    return (
        f"You are the assistant of company {tenant}, an expert on {TOPICS[tenant % len(TOPICS)]}. "
        + " ".join(rng.choice(vocab) for _ in range(words))
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^pagedkv:{name}\{{.*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run(routing: str, serve_args: list[str], prompts: list[str], concurrency: int) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "serve",
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--routing",
        routing,
        *serve_args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        while "pagedkv serves" not in Path(log.name).read_text():
            if proc.poll() is not None:
                raise SystemExit(Path(log.name).read_text()[-3000:])
            time.sleep(0.5)
        while len(httpx.get(f"{url}/v1/kv", timeout=60).json()["replicas"]) < 2:
            time.sleep(0.5)
        start = time.monotonic()

        def send(prompt: str) -> None:
            r = httpx.post(
                f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=600
            )
            r.raise_for_status()

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(send, prompts))
        seconds = time.monotonic() - start
        text = httpx.get(f"{url}/metrics", timeout=60).text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        os.unlink(log.name)
    queries, hits = (
        metric(text, "prefix_cache_queries_total"),
        metric(text, "prefix_cache_hits_total"),
    )
    return {
        "routing": routing,
        "queries": queries,
        "hits": hits,
        "computed": queries - hits,
        "seconds": seconds,
    }


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--users", type=int, default=5, help="requests per tenant")
    p.add_argument("--words", type=int, default=400, help="words of each system prompt")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    prompts = [
        f"{system_prompt(t, args.words)}\nUser {u}: what do you recommend today?"
        for t in range(args.tenants)
        for u in range(args.users)
    ]
    random.Random(args.seed).shuffle(prompts)
    print(
        f"{len(prompts)} requests: {args.tenants} tenants x {args.users} users, system prompts of "
        f"{args.words} words, {args.concurrency} at a time, 2 replicas; "
        f"serve {' '.join(serve_args)}"
    )
    print(
        f"{'routing':<14}{'prompt tokens':>14}{'cache hits':>12}{'hit rate':>10}"
        f"{'computed':>10}{'seconds':>9}"
    )
    for routing in ("round-robin", "prefix-aware"):
        r = run(routing, serve_args, prompts, args.concurrency)
        rate = r["hits"] / r["queries"] if r["queries"] else 0.0
        print(
            f"{routing:<14}{r['queries']:>14,.0f}{r['hits']:>12,.0f}{100 * rate:>9.1f}%"
            f"{r['computed']:>10,.0f}"
            f"{r['seconds']:>9.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

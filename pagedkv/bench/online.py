"""Online runs: `pagedkv serve` in a subprocess, and an OpenAI-protocol load generator against it.

Each request is a streaming /v1/completions call with a token-id prompt,
greedy, EOS ignored. TTFT is the time to the first chunk carrying text, ITL
the gaps between chunks (as vLLM's serving benchmark measures them), and the
token count comes from the stream's usage chunk. The server's /metrics is
scraped during the run for running requests and KV usage over time, and
before and after it for prefix-cache and preemption counters.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.bench.metrics import CpuMeter
from pagedkv.bench.result import RunResult, measured_result
from pagedkv.bench.workloads import BenchRequest, Workload, token_range
from pagedkv.config import ConfigError

METRIC = "pagedkv:"


@dataclass
class LoadSpec:
    concurrency: int | None = None  # at most this many requests in flight (None: no limit)
    request_rate: float = math.inf  # Poisson arrivals per second (inf: all at once)
    seed: int = 0


@dataclass
class RequestRecord:
    start: float
    chunk_times: list[float] = field(default_factory=list)
    end: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


# ---------------------------------------------------------------- the server process


def engine_flags(options: dict) -> list[str]:
    """EngineConfig options -> `pagedkv serve` flags (booleans become --x / --no-x)."""
    flags: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):  # --served-model-name a b
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedkv serve` on a free loopback port for the length of a `with` block.

    Its log goes to a file."""

    def __init__(self, options: dict, startup_timeout: float = 600.0) -> None:
        self.options = options
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="pagedkv-bench-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> ServerProcess:
        import httpx

        cmd = [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *engine_flags(self.options),
        ]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            while time.monotonic() - t0 < self.startup_timeout:
                if self.proc.poll() is not None:
                    raise ConfigError(
                        f"pagedkv serve exited with code {self.proc.returncode} before it was "
                        f"ready: {self._last_log_line()} (log: {self.log_path})"
                    )
                try:
                    if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                        self.startup_s = round(time.monotonic() - t0, 2)
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            raise ConfigError(
                f"pagedkv serve was not ready after {self.startup_timeout:.0f}s "
                f"(log: {self.log_path})"
            )
        except BaseException:
            # SIGTERM and Ctrl-C too: `with` calls no __exit__ when __enter__ fails, and the
            # server, in a session of its own, would run on (it did: an orphan on its port)
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s: our own child only, by its process id."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _last_log_line(self) -> str:
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "(no output)"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name without the pagedkv: prefix: value}, summed over label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0][len(METRIC) :]
        try:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return values


# ---------------------------------------------------------------- the load generator


async def _stream_one(
    client, model: str, req: BenchRequest, sem: asyncio.Semaphore | None
) -> RequestRecord:
    if sem is not None:
        await sem.acquire()
    rec = RequestRecord(start=time.perf_counter())
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                body_text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body_text[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                _read_chunk(json.loads(data), rec, time.perf_counter())
    except Exception as e:  # noqa: BLE001 - one failed request is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end = time.perf_counter()
        if sem is not None:
            sem.release()
    return rec


def _read_chunk(obj: dict, rec: RequestRecord, now: float) -> None:
    if "error" in obj:
        rec.error = str(obj["error"].get("message", obj["error"]))
        return
    if any(c.get("text") for c in obj.get("choices") or ()):
        rec.chunk_times.append(now)
    usage = obj.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens", 0))
        rec.cached_tokens = int(
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        )


async def generate_load(
    client, model: str, requests: list[BenchRequest], load: LoadSpec, on_done=None
) -> list[RequestRecord]:
    """Send every request (Poisson arrivals or all at once, at most `concurrency` in flight)."""
    sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    rng = random.Random(load.seed)
    tasks = []
    for i, req in enumerate(requests):
        task = asyncio.create_task(_stream_one(client, model, req, sem))
        if on_done is not None:
            task.add_done_callback(lambda _t: on_done())
        tasks.append(task)
        if math.isfinite(load.request_rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(load.request_rate))
    return list(await asyncio.gather(*tasks))


async def _poll_metrics(
    client, t0: float, series: dict[str, list], stop: asyncio.Event, every: float
) -> None:
    while not stop.is_set():
        try:
            m = parse_metrics((await client.get("/metrics")).text)
        except Exception:  # noqa: BLE001 - a missed scrape only leaves a gap in the plot
            m = None
        if m is not None:
            series["t"].append(round(time.perf_counter() - t0, 3))
            series["running"].append(int(m.get("num_requests_running", 0)))
            series["waiting"].append(int(m.get("num_requests_waiting", 0)))
            series["kv_usage"].append(round(m.get("kv_cache_usage_perc", 0.0), 5))
            series["kv_util"].append(
                round(m["kv_token_utilization"], 5) if m.get("kv_cache_usage_perc") else None
            )
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def _run_async(
    base_url: str,
    workload: Workload,
    load: LoadSpec,
    progress: bool,
    label: str,
    vocab_size: int,
    poll_every: float,
):
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=max(len(workload.requests), 1) + 4)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(None), limits=limits
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        lo, _ = token_range(vocab_size)
        warm = await _stream_one(client, model, BenchRequest(list(range(lo, lo + 8)), 2), None)
        if warm.error:
            raise ConfigError(f"the warm-up request failed: {warm.error}")
        before = parse_metrics((await client.get("/metrics")).text)
        series: dict[str, list] = {
            "t": [],
            "running": [],
            "waiting": [],
            "kv_usage": [],
            "kv_util": [],
        }
        stop = asyncio.Event()
        bar = tqdm(
            total=len(workload.requests),
            desc=f"{workload.key} {label}",
            unit="req",
            disable=not progress,
            dynamic_ncols=True,
            leave=False,
        )
        t0 = time.perf_counter()
        poller = asyncio.create_task(_poll_metrics(client, t0, series, stop, poll_every))
        records = await generate_load(client, model, workload.requests, load, lambda: bar.update(1))
        wall = time.perf_counter() - t0
        stop.set()
        await poller
        bar.close()
        after = parse_metrics((await client.get("/metrics")).text)
    return records, wall, series, before, after


def records_result(
    records: list[RequestRecord],
    wall: float,
    workload: Workload,
    label: str,
    options: dict,
    series: dict,
    before: dict,
    after: dict,
    extra: dict,
) -> RunResult:
    """Aggregate the per-request records and the server's counters into a RunResult."""
    ok = [r for r in records if r.error is None]
    ttft = [r.chunk_times[0] - r.start for r in ok if r.chunk_times]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [r.end - r.start for r in ok if r.end is not None]  # set for every returned record
    out_tokens = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    errors = [r.error for r in records if r.error]
    return measured_result(
        label=label,
        mode="online",
        workload=workload,
        options=options,
        prefix_hits=delta("prefix_cache_hits_total"),
        prefix_queries=delta("prefix_cache_queries_total"),
        requests=len(ok),
        output_tokens=out_tokens,
        cached_tokens=cached,
        wall=wall,
        latencies={"ttft": ttft, "itl": itl, "e2e": e2e},
        peak_running=max(series["running"], default=None),
        kv_util_mean=_mean([u for u in series["kv_util"] if u is not None]),
        kv_usage_peak=max(series["kv_usage"], default=None),
        preemptions=int(delta("num_preemptions_total")),
        errors=len(errors),
        extra={**extra, **({"first_error": errors[0]} if errors else {})},
        timeline=series,
    )


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 5) if values else None


def run_online(
    server: ServerProcess,
    workload: Workload,
    label: str,
    options: dict,
    load: LoadSpec,
    vocab_size: int,
    progress: bool = True,
    poll_every: float = 0.5,
) -> RunResult:
    """Run the workload against a started server and measure it from the client's side."""
    with CpuMeter() as cpu:  # the server is our child: its CPU counts as our own
        records, wall, series, before, after = asyncio.run(
            _run_async(server.base_url, workload, load, progress, label, vocab_size, poll_every)
        )
    extra = {
        "concurrency": load.concurrency,
        "request_rate": None if math.isinf(load.request_rate) else load.request_rate,
        "server_startup_s": server.startup_s,
    }
    result = records_result(records, wall, workload, label, options, series, before, after, extra)
    result.peak_rss_mb = _server_rss_mb(server)
    result.other_load = cpu.other_load
    return result


def _server_rss_mb(server: ServerProcess) -> float | None:
    """The server's peak RSS (VmHWM) from /proc, where there is one."""
    if server.proc is None:
        return None
    try:
        for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def model_vocab_size(model: str | None) -> int:
    """The vocabulary size from the model's config, without building its weights."""
    from pagedkv.model.loader import read_checkpoint

    return read_checkpoint(model)[0].config.vocab_size

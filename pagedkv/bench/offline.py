"""Offline runs: drive LLMEngine step by step, sampling the scheduler and the KV pool after
every step.

All requests arrive at once (as in `LLM.generate`); the clock runs from the
first add_request to the last finished request. A tiny warm-up request runs
first and is not counted; the prefix cache is emptied after it.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from pagedkv.bench.metrics import CpuMeter, rss_mb
from pagedkv.bench.result import RunResult, measured_result
from pagedkv.bench.workloads import Workload, token_range
from pagedkv.config import EngineConfig


@dataclass
class EngineFactory:
    """Builds one engine per run, loading the model once and sharing it.

    Runs differ only in their cache options."""

    base: dict  # EngineConfig options common to every run
    _loaded: object = field(default=None, repr=False)
    load_s: float | None = None

    def build(self, **overrides):
        from pagedkv.engine.llm_engine import LLMEngine

        if "dtype" in overrides or "model" in overrides:
            raise ValueError("runs share one model: dtype and model belong in the base options")
        config = EngineConfig.from_options(**{**self.base, **overrides})
        # tensor parallelism cuts rank 0's model in place: every such run loads it again
        shared = self._loaded if config.tensor_parallel_size == 1 else None
        t0 = time.monotonic()
        engine = LLMEngine(config, loaded=shared)
        if shared is None:
            self._loaded, self.load_s = engine.loaded, round(time.monotonic() - t0, 2)
        return engine


@dataclass
class _Timeline:
    t: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    kv_util: list[float | None] = field(default_factory=list)
    rss_peak: float = 0.0

    def sample(self, engine, t: float) -> None:
        sch, kv = engine.scheduler, engine.kv.stats()
        self.t.append(round(t, 4))
        self.running.append(len(sch.running))
        self.waiting.append(len(sch.waiting))
        self.kv_usage.append(round(kv.usage, 5))
        self.kv_util.append(round(kv.tokens_held / kv.token_slots, 5) if kv.token_slots else None)
        self.rss_peak = max(self.rss_peak, rss_mb())

    def util_mean(self) -> float | None:
        vals = [u for u in self.kv_util if u is not None]
        return round(sum(vals) / len(vals), 5) if vals else None

    def series(self) -> dict[str, list]:
        """What RunResult.timeline holds: the sampled series, not the RSS peak."""
        return {
            "t": self.t,
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "kv_util": self.kv_util,
        }


@dataclass
class _Drive:
    """What one timed pass over a workload saw."""

    outputs: list  # the final RequestOutput of each request
    wall_s: float
    timeline: _Timeline
    other_load: float | None


def _greedy(max_tokens: int):
    from pagedkv.engine.request import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def warm_up(engine) -> None:
    """One tiny request through every code path once (not timed), then forget its cached blocks."""
    lo, _ = token_range(engine.vocab_size)
    engine.add_request("bench-warmup", list(range(lo, lo + 8)), _greedy(2))
    _drain(engine)
    engine.kv.reset_prefix_cache()


def latencies(outputs) -> dict[str, list[float]]:
    """TTFT, inter-token gaps and end-to-end seconds from each RequestOutput's metrics."""
    ttft: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    for out in outputs:
        m = out.metrics
        if m.first_token_time is not None:
            ttft.append(m.first_token_time - m.arrival_time)
        itl.extend(b - a for a, b in zip(m.token_times, m.token_times[1:]))
        if m.finished_time is not None:
            e2e.append(m.finished_time - m.arrival_time)
    return {"ttft": ttft, "itl": itl, "e2e": e2e}


def run_offline(
    engine, workload: Workload, label: str, options: dict, progress: bool = True
) -> RunResult:
    """Run the whole workload through `engine` and measure it."""
    warm_up(engine)
    gc.collect()
    kv0, pre0 = engine.kv.stats(), engine.scheduler.num_preemptions
    run = _drive(engine, workload, label, progress)
    kv1 = engine.kv.stats()
    outputs, wall, timeline = run.outputs, run.wall_s, run.timeline
    out_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return measured_result(
        label=label,
        mode="offline",
        workload=workload,
        options=options,
        prefix_hits=kv1.prefix_hits - kv0.prefix_hits,
        prefix_queries=kv1.prefix_queries - kv0.prefix_queries,
        requests=len(outputs),
        output_tokens=out_tokens,
        cached_tokens=cached,
        wall=wall,
        latencies=latencies(outputs),
        peak_running=max(timeline.running),
        kv_util_mean=timeline.util_mean(),
        kv_usage_peak=max(timeline.kv_usage),
        preemptions=engine.scheduler.num_preemptions - pre0,
        peak_rss_mb=round(timeline.rss_peak, 1),
        other_load=run.other_load,
        extra={
            "steps": len(timeline.t) - 1,
            "kv_blocks": kv1.num_blocks,
            "block_size": engine.kv.block_size,
            "kv_token_capacity": kv1.num_blocks * engine.kv.block_size,
            "max_model_len": engine.max_model_len,
        },
        timeline=timeline.series(),
    )


def _drive(engine, workload: Workload, label: str, progress: bool) -> _Drive:
    """Add every request at once, then step until all finish, sampling after each step."""
    from tqdm import tqdm

    gen0 = engine.generation_tokens_total
    timeline = _Timeline()
    bar = tqdm(
        total=workload.output_tokens,
        desc=f"{workload.key} {label}",
        unit="tok",
        disable=not progress,
        dynamic_ncols=True,
        leave=False,
    )
    finals = {}
    with CpuMeter() as cpu:
        t0 = time.monotonic()
        for i, r in enumerate(workload.requests):
            engine.add_request(f"bench-{i}", r.prompt, _greedy(r.max_tokens))
        timeline.sample(engine, 0.0)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            timeline.sample(engine, time.monotonic() - t0)
            bar.update(engine.generation_tokens_total - gen0 - bar.n)
        wall = time.monotonic() - t0
    bar.close()
    return _Drive(list(finals.values()), wall, timeline, cpu.other_load)

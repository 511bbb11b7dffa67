"""What one benchmark run reports, the same shape offline and online.

Online runs leave the engine-internal fields None.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pagedkv.bench.metrics import summarize
from pagedkv.bench.workloads import Workload


@dataclass
class RunResult:
    label: str  # the configuration, e.g. "paged, prefix on"
    mode: str  # "offline" | "online"
    workload: str  # "W1", "W2", "W3" or a trace's stem
    options: dict  # engine options that differ from the defaults
    requests: int
    prompt_tokens: int  # sent
    output_tokens: int  # received
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    requests_per_s: float
    ttft: dict  # metrics.summarize() of seconds
    itl: dict
    e2e: dict
    peak_running: int | None = None
    kv_util_mean: float | None = None  # mean over steps of tokens held / slots allocated
    kv_usage_peak: float | None = None  # peak share of the pool's blocks in use
    prefix_hit_rate: float | None = None  # prompt tokens served from the cache / looked up
    cached_tokens: int | None = None
    prompt_tokens_computed: int | None = None  # sent - cached
    preemptions: int | None = None
    peak_rss_mb: float | None = None
    other_load: float | None = None  # cores other processes kept busy on average (noise)
    errors: int = 0
    extra: dict = field(default_factory=dict)
    # series for the plots: {"t": [...], "running": [...], "kv_usage": [...], "kv_util": [...]}
    timeline: dict = field(default_factory=dict)
    # raw latencies in seconds for the plots: {"ttft": [...], "itl": [...], "e2e": [...]}
    latencies: dict = field(default_factory=dict)

    def to_json(self, with_series: bool = True) -> dict:
        d = asdict(self)
        if not with_series:
            d.pop("timeline")
            d.pop("latencies")
        return d

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        return cls(**d)


def rate(count: float, seconds: float) -> float:
    return round(count / seconds, 2) if seconds > 0 else 0.0


def measured_result(
    *,
    label: str,
    mode: str,
    workload: Workload,
    options: dict,
    prefix_hits: float,
    prefix_queries: float,
    requests: int,
    output_tokens: int,
    cached_tokens: int,
    wall: float,
    latencies: dict[str, list[float]],
    **mode_fields,
) -> RunResult:
    """A RunResult from what offline and online runs both measure; `mode_fields` are the rest.

    `latencies` holds raw seconds under "ttft", "itl" and "e2e"."""
    prompt_tokens = workload.prompt_tokens
    return RunResult(
        label=label,
        mode=mode,
        workload=workload.key,
        options=options,
        requests=requests,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        wall_s=round(wall, 4),
        output_tok_s=rate(output_tokens, wall),
        total_tok_s=rate(prompt_tokens + output_tokens, wall),
        requests_per_s=rate(requests, wall),
        ttft=summarize(latencies["ttft"]),
        itl=summarize(latencies["itl"]),
        e2e=summarize(latencies["e2e"]),
        prefix_hit_rate=round(prefix_hits / prefix_queries, 4) if prefix_queries else 0.0,
        cached_tokens=cached_tokens,
        prompt_tokens_computed=prompt_tokens - cached_tokens,
        latencies={k: [round(x, 5) for x in v] for k, v in latencies.items()},
        **mode_fields,
    )

"""Prometheus metrics for `GET /metrics`, named like vLLM's with the `pagedkv:` prefix.

Every series vLLM's reference Grafana dashboard reads exists here with vLLM's
meaning (examples/grafana.json is a dashboard over them). Engine gauges and
counters are read from `engine.stats()` at scrape time by a custom collector,
so they can never drift from what the engine did; the per-request histograms
are kept here, fed from each finished request's timestamps and token counts.
A private registry keeps several apps in one process (tests) apart.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from pagedkv.engine.outputs import RequestMetrics, RequestOutput

P = "pagedkv:"

# buckets follow vLLM's, so existing dashboards read them the same way
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)  # also the queue / prefill / decode / inference times


def tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to max_model_len, for the prompt / generation length histograms."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# (metric name, EngineStats field, help)
_GAUGES = (
    ("kv_cache_usage_perc", "kv_usage", "Fraction of KV-cache blocks in use (0..1)."),
    (
        "kv_token_utilization",
        "token_utilization",
        "Fraction of the token slots of used blocks that hold real tokens.",
    ),
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("num_requests_swapped", "num_swapped", "Requests whose blocks are swapped to host memory."),
    ("kv_cache_num_blocks", "num_blocks", "Blocks in the KV pool."),
    ("kv_cache_free_blocks", "num_free_blocks", "Free blocks in the KV pool (cached or not)."),
    ("kv_cache_cached_blocks", "num_cached_blocks", "Blocks holding a reusable prefix."),
    ("kv_cache_capacity_tokens", "token_capacity", "Tokens the KV pool can hold."),
    (
        "model_weight_bytes",
        "model_weight_bytes",
        "Resident bytes of the model weights (after --quantization).",
    ),
)
_COUNTERS = (
    ("prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Requests preempted (recompute or swap)."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens processed (prefilled)."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
    (
        "kv_offload_hits",
        "offload_hits",
        "Prompt tokens loaded back from the host-memory or disk KV tiers.",
    ),
    (
        "kv_offload_saved_blocks",
        "offload_saved_blocks",
        "Evicted KV blocks kept in the host-memory or disk tiers.",
    ),
    (
        "spec_decode_num_drafts",
        "spec_num_drafts",
        "Speculative steps of a sequence (each with its drafts).",
    ),
    ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Speculative tokens proposed."),
    ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Speculative tokens accepted."),
    (
        "kv_offload_disk_writes_dropped",
        "offload_disk_writes_dropped",
        "KV blocks not written through to the disk tier because its write queue was full.",
    ),
)


class _EngineCollector(Collector):
    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        for name, field, doc in _GAUGES:
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, field)))
            yield g
        for name, field, doc in _COUNTERS:
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, field)))
            yield c
        steps = self.engine.engine.step_tokens
        h = HistogramMetricFamily(
            P + "iteration_tokens_total", "Tokens scheduled per engine step.", labels=["model_name"]
        )
        h.add_metric(
            [self.model_name], [(le, float(n)) for le, n in steps.cumulative()], float(steps.total)
        )
        yield h
        labels = self.cache_labels(stats.num_blocks)
        info = GaugeMetricFamily(
            P + "cache_config_info",
            "The KV cache's configuration (value is 1).",
            labels=list(labels),
        )
        info.add_metric(list(labels.values()), 1.0)
        yield info

    def cache_labels(self, num_blocks: int) -> dict[str, str]:
        c = self.engine.config
        return {
            "block_size": str(c.block_size),
            "cache_dtype": c.kv_cache_dtype,
            "enable_prefix_caching": str(c.enable_prefix_caching),
            "gpu_memory_utilization": str(c.memory_utilization),
            "num_gpu_blocks": str(num_blocks),
            "swap_space_bytes": str(c.swap_space_bytes),
            "preemption_mode": c.preemption_mode,
        }


class ServerMetrics:
    """The registry behind /metrics, plus latency histograms fed by `observe`."""

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between a request's steps that made tokens.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "Arrival to finish of a request.", E2E_BUCKETS
        )
        self.queue = hist(
            "request_queue_time_seconds", "Arrival to first scheduled (waiting).", E2E_BUCKETS
        )
        self.prefill = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS
        )
        self.decode = hist("request_decode_time_seconds", "First token to last token.", E2E_BUCKETS)
        self.inference = hist(
            "request_inference_time_seconds",
            "First scheduled to last token (running).",
            E2E_BUCKETS,
        )
        lengths = tokens_buckets(engine.max_model_len)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.gen_len = hist(
            "request_generation_tokens", "Generated tokens per request (all samples).", lengths
        )
        self.max_gen = hist(
            "request_max_num_generation_tokens",
            "Generated tokens of a request's longest sample.",
            lengths,
        )
        self._success = Counter(
            P + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request (call once per request)."""
        reason = out.outputs[0].finish_reason if out.outputs else None
        self._success.labels(self.model_name, reason or "unknown").inc()
        generated = [len(o.token_ids) for o in out.outputs]
        self.prompt_len.observe(len(out.prompt_token_ids))
        self.gen_len.observe(sum(generated))
        self.max_gen.observe(max(generated, default=0))
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        # one gap per step, as vLLM: a step's tokens (accepted drafts too) share its time
        steps = list(dict.fromkeys(m.token_times))
        for a, b in zip(steps, steps[1:]):
            self.itl.observe(b - a)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self._phases(m)

    def observe_pooling(self, prompt_tokens: int) -> None:
        """Record a finished pooling request (an embedding, a text scored): a success ("stop", as
        vLLM counts one) and its prompt's length; it generates nothing."""
        self._success.labels(self.model_name, "stop").inc()
        self.prompt_len.observe(prompt_tokens)

    def ended_early(self, reason: str) -> None:
        """Record a request that ended before its final output, under vLLM's finished_reason:
        "abort" (its client went away) or "error" (it failed inside the engine, a 500); its
        latencies and lengths are not known, so not observed."""
        self._success.labels(self.model_name, reason).inc()

    def _phases(self, m: RequestMetrics) -> None:
        """vLLM's phases: queued -> scheduled -> first token -> last token."""
        start, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if start is None:
            return
        self.queue.observe(start - m.arrival_time)
        if first is not None:
            self.prefill.observe(first - start)
        if first is not None and last is not None:
            self.decode.observe(last - first)
            self.inference.observe(last - start)

    def render(
        self, names: list[str] | None = None, accept: str = "", accept_encoding: str = ""
    ) -> tuple[bytes, dict[str, str]]:
        """The exposition (see `exposition`); with `names`, only the samples of those names
        (vLLM's name[] filter; restricted_registry cannot see the names of collectors that
        describe nothing)."""
        source = _Only(self.registry, set(names)) if names else self.registry
        return exposition(source, accept, accept_encoding)


def exposition(
    source: Collector, accept: str = "", accept_encoding: str = ""
) -> tuple[bytes, dict[str, str]]:
    """A scrape's body and headers as prometheus_client's own /metrics app (vLLM's) gives them:
    OpenMetrics when the Accept header asks for it, as Prometheus does, else the text format;
    gzip when Accept-Encoding takes it."""
    encode, content_type = choose_encoder(accept)
    if isinstance(encode, partial) and encode.keywords.get("escaping") == openmetrics.UNDERSCORES:
        # Underscore escaping keeps a legal legacy name (all of ours: `pagedkv:...`) as it is, but
        # prometheus_client writes its sample lines with ':' as '_' while HELP and TYPE keep it
        # (prometheus/client_python#1177): what Prometheus 2 asks for. Written unescaped instead.
        encode = partial(encode, escaping=openmetrics.ALLOWUTF8)
    body, headers = encode(source), {"Content-Type": content_type}
    if gzip_accepted(accept_encoding):
        body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
    return body, headers


@dataclass
class _Only:
    """A registry's families cut to the samples of some names."""

    registry: CollectorRegistry
    names: set[str]

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if s.name in self.names]
            if family.samples:
                yield family

"""One answer from several replicas: /metrics summed over replicas, /v1/kv with each replica's pool.

Counters and histograms add up; gauges add up too (running requests, blocks) except ratios
(usage, utilization, hit rates), which are averaged; `_created` times take the
earliest. No Ray import: plain text in.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

RATIO_WORDS = ("perc", "usage", "utilization", "rate")


class _Fixed:
    """A prometheus collector that yields fixed metric families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def merge_metrics(texts: list[str]) -> CollectorRegistry:
    """Prometheus text of each replica -> one registry with every series combined (rendered as
    the scraper asks: metrics.exposition)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, list[float]]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            series = values.setdefault(fam.name, {})
            for s in fam.samples:
                series.setdefault((s.name, tuple(sorted(s.labels.items()))), []).append(s.value)
    for name, fam in families.items():
        average = fam.type == "gauge" and any(w in name for w in RATIO_WORDS)
        for (sample, labels), vals in values[name].items():
            if sample.endswith("_created"):  # a start time: the earliest replica's
                value = min(vals)
            else:
                value = sum(vals) / len(vals) if average else sum(vals)
            fam.add_sample(sample, dict(labels), value)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return registry


def merge_kv(snapshots: list[dict]) -> dict:
    """Replica 0's snapshot at the top (what the dashboard draws), every replica's in "replicas"."""
    if not snapshots:
        return {"replicas": []}
    return {**snapshots[0], "replicas": snapshots}

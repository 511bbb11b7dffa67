"""PNG charts of a bench run (matplotlib, Agg backend).

Throughput, latency distributions and KV use over time.
"""

from __future__ import annotations

from pathlib import Path

from pagedkv.bench.result import RunResult
from pagedkv.plotting import pyplot


def _name(r: RunResult) -> str:
    return f"{r.workload} {r.label}" + (" (online)" if r.mode == "online" else "")


def plot_all(results: list[RunResult], out_dir: str | Path) -> list[Path]:
    """Write throughput.png, latency.png and kv.png into out_dir; returns their paths."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        _throughput(plt, results, out / "throughput.png"),
        _latency(plt, results, out / "latency.png"),
        _kv(plt, results, out / "kv.png"),
    ]
    return [p for p in paths if p is not None]


def _throughput(plt, results: list[RunResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(results) + 1.5))
    names = [_name(r) for r in results]
    ax.barh(names, [r.output_tok_s for r in results], color="tab:blue", label="output tok/s")
    for i, r in enumerate(results):
        ax.text(r.output_tok_s, i, f" {r.output_tok_s:.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / s (whole workload)")
    ax.set_title("Throughput per configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency(plt, results: list[RunResult], path: Path) -> Path | None:
    kinds = [
        ("ttft", "time to first token (s)"),
        ("itl", "inter-token latency (ms)"),
        ("e2e", "end-to-end (s)"),
    ]
    with_data = [r for r in results if r.latencies.get("e2e")]
    if not with_data:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.45 * len(with_data) + 2), sharey=True)
    labels = [_name(r) for r in with_data]
    for ax, (kind, title) in zip(axes, kinds):
        scale = 1000.0 if kind == "itl" else 1.0
        data = [[v * scale for v in r.latencies.get(kind) or [0.0]] for r in with_data]
        ax.boxplot(data, orientation="horizontal", showfliers=False, whis=(1, 99))
        ax.set_title(title + ", whiskers p1-p99")
    axes[0].set_yticks(range(1, len(labels) + 1), labels)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kv(plt, results: list[RunResult], path: Path) -> Path | None:
    with_data = [r for r in results if r.timeline.get("t")]
    if not with_data:
        return None
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for r in with_data:
        t = r.timeline["t"]
        (line,) = top.plot(t, r.timeline["kv_usage"], label=_name(r))
        util = [(x, u) for x, u in zip(t, r.timeline["kv_util"]) if u is not None]
        if util:
            mid.plot(*zip(*util), color=line.get_color())
        bottom.plot(t, r.timeline["running"], color=line.get_color())
    top.set_ylabel("pool blocks in use")
    mid.set_ylabel("token utilization\n(held / allocated slots)")
    bottom.set_ylabel("running requests")
    bottom.set_xlabel("seconds since the first request")
    top.legend(fontsize=7, loc="upper right")
    top.set_title("KV cache over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

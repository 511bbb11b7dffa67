"""PNG charts for `pagedkv simulate --plot` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.config import ConfigError
from pagedkv.plotting import pyplot

if TYPE_CHECKING:
    from pagedkv.sim.dynamic import DynamicResult
    from pagedkv.sim.simulate import SimResult


def _save(fig, path: str) -> None:
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as e:
        raise ConfigError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        pyplot().close(fig)


def plot_static(result: SimResult, path: str) -> None:
    """Left: the pool split into real tokens / reserved but empty / unreserved.

    Right: the requests that fit."""
    plt = pyplot()
    names = [r.policy for r in result.policies]
    pool = max(result.pool_tokens, 1)
    real = [100 * r.real_tokens / pool for r in result.policies]
    empty = [100 * (r.reserved_tokens - r.real_tokens) / pool for r in result.policies]
    free = [100 - a - b for a, b in zip(real, empty)]
    fig, (ax_mem, ax_fit) = plt.subplots(1, 2, figsize=(11, 0.7 * len(names) + 2.6))
    ax_mem.barh(names, real, color="#2a9d8f", label="real tokens")
    ax_mem.barh(names, empty, left=real, color="#e76f51", label="reserved, empty")
    ax_mem.barh(
        names,
        free,
        left=[a + b for a, b in zip(real, empty)],
        color="#d9d9d9",
        label="not reserved",
    )
    ax_mem.set_xlim(0, 100)
    ax_mem.set_xlabel(f"% of KV pool ({result.pool_tokens:,} token slots)")
    ax_mem.invert_yaxis()
    ax_mem.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8)
    fits = [r.requests_fit for r in result.policies]
    ax_fit.barh(names, fits, color="#264653")
    for y, n in enumerate(fits):
        ax_fit.text(n, y, f" {n}", va="center", fontsize=9)
    ax_fit.set_xlabel("requests that fit")
    ax_fit.invert_yaxis()
    ax_fit.set_xlim(0, max(fits + [1]) * 1.15)
    fig.suptitle("KV memory holding real tokens, and requests that fit")
    fig.tight_layout()
    _save(fig, path)


def plot_dynamic(results: Sequence[DynamicResult], path: str) -> None:
    """Token utilization and running requests per step, one line per policy."""
    plt = pyplot()
    fig, (ax_util, ax_run) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for r in results:
        ax_util.plot(r.times, [100 * u for u in r.utilization], label=r.policy, linewidth=1.2)
        ax_run.plot(r.times, r.running, label=r.policy, linewidth=1.2)
    ax_util.set_ylabel("token utilization (%)")
    ax_util.set_ylim(0, 105)
    ax_util.legend(fontsize=8)
    ax_run.set_ylabel("running requests")
    ax_run.set_xlabel("step")
    fig.suptitle("Replay through the block manager")
    fig.tight_layout()
    _save(fig, path)

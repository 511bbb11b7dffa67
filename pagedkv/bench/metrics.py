"""Small measurement helpers shared by the offline and online runners."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

PERCENTILES = (50, 90, 99)
MIN_METERED_S = 1.0


def summarize(values: list[float]) -> dict[str, float | int]:
    """count, mean and p50/p90/p99 of latencies in seconds (rounded to 0.1 ms).

    An empty list gives count 0."""
    if not values:
        return {"count": 0}
    import numpy as np

    arr = np.asarray(values, dtype=float)
    out: dict[str, float | int] = {"count": int(arr.size), "mean": round(float(arr.mean()), 4)}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{p}"] = round(float(v), 4)
    return out


def rss_mb() -> float:
    """Current resident memory of this process in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _busy_cpu_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds used by this process and its live children (the server, online)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CpuMeter:
    """How much other work shared the cores during a run: machine busy CPU minus our own,
    in seconds.

    The cores are shared, so a figure measured next to other work is slower than the engine is;
    `other_load` (other processes' average busy cores) says how much to distrust it."""

    def __enter__(self) -> CpuMeter:
        self.other_cpu_s: float | None = None
        self._busy0: float | None
        try:
            self._busy0, self._own0, self._t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
        except (OSError, ValueError, IndexError):
            self._busy0 = None
        return self

    def __exit__(self, *exc) -> None:
        if self._busy0 is None:
            return
        self.seconds = time.monotonic() - self._t0
        self.own_cpu_s = _own_cpu_s() - self._own0
        self.other_cpu_s = max(0.0, _busy_cpu_s() - self._busy0 - self.own_cpu_s)

    @property
    def other_load(self) -> float | None:
        """Average number of cores other processes kept busy.

        None for runs under a second, where the kernel's 10 ms accounting ticks make the
        figure meaningless."""
        if self.other_cpu_s is None or self.seconds < MIN_METERED_S:
            return None
        return round(min(self.other_cpu_s / self.seconds, float(os.cpu_count() or 1)), 2)


def machine_info() -> dict:
    """CPU model, core count, memory and software versions, for the report header."""
    import torch

    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_total_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def git_commit() -> str | None:
    """The repository's HEAD ('+dirty' when our own files changed); None outside a checkout."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "pagedkv"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")

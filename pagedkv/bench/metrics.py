"""Small measurement helpers shared by the offline and online runners."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

PERCENTILES = (50, 90, 99)


def summarize(values: list[float]) -> dict[str, float | int]:
    """count, mean and p50/p90/p99 of latencies in seconds (rounded to 0.1 ms); empty gives count 0."""
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


def machine_info() -> dict:
    """CPU model, core count, memory and software versions, for the report header."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "platform": platform.platform()}
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
    """The repository's HEAD (with '+dirty' when our own files changed), or None outside a checkout."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "pagedkv"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")

"""Start-up measurements kept across runs: one JSON file per kind of verdict, keyed by what the
measurement depends on (the CPU, the torch build, the thread count, the model's shapes).

A choice made by timing (`--dtype auto`, where the dense weight copies take over) costs a
second or less, once per machine; later starts read the verdict. The directory is
$PAGEDKV_EXT_DIR, else ~/.cache/pagedkv (or $XDG_CACHE_HOME/pagedkv).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("pagedkv")


def cpu_identity() -> str:
    """The CPU, plus the variables that cap which instructions torch's matmuls and our kernels
    (PAGEDKV_CPU_ISA) may use."""
    model = (
        platform.processor()
        + os.environ.get("ONEDNN_MAX_CPU_ISA", "")
        + os.environ.get("ATEN_CPU_CAPABILITY", "")
        + os.environ.get("PAGEDKV_CPU_ISA", "")
    )
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                model += line
    except OSError:
        pass
    return hashlib.sha256(model.encode()).hexdigest()[:16]


def machine_key(*parts: object) -> str:
    """A cache key: CPU, torch version, torch threads, then what the measurement timed."""
    head = f"{cpu_identity()}:{torch.__version__}:{torch.get_num_threads()}"
    return ":".join([head, *map(str, parts)])


def cache_file(name: str) -> Path:
    base = os.environ.get("PAGEDKV_EXT_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "pagedkv",
    )
    return Path(base) / name


def cached(name: str, key: str, valid: Callable[[dict], bool], measure: Callable[[], dict]) -> dict:
    """The entry under `key` in the cache file `name`; measured (and stored) when it is missing
    or fails `valid` (a damaged file is measured again, never trusted)."""
    path = cache_file(name)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    entry = cache.get(key)
    if isinstance(entry, dict) and valid(entry):
        return entry
    entry = cache[key] = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache only costs the measurement on every start
        log.warning("cannot cache a start-up measurement in %s: %s", path, e)
    return entry

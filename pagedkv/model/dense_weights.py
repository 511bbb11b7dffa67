"""Dense copies of the packed weights, for matmuls of many rows; where "many" starts is
measured on this CPU with the model's own weights. The copies are bfloat16, prepacked for oneDNN,
where oneDNN runs bf16 GEMMs (AVX-512); elsewhere they are in the model's dtype: float32 where
`--dtype auto` found bf16 GEMMs slow, and there a float32 GEMM beats the int4 kernel from about
32 rows (BENCHMARKS.md, "AVX2, emulated").

torch's packed CPU kernels (int4 for a GGUF's 4-bit blocks, int8) read a quarter / half of the
bytes of bfloat16, which wins a step of a few rows (bound by reading the weights: W3 decodes 2x
faster), but their cost grows row by row, where a dense GEMM blocks for compute: on a 2-core
AVX-512 BF16 EPYC the default model's int4 matrices lose to bf16 from 16-24 rows, its int8
lm_head from 12-16 (BENCHMARKS.md, "Packed and dense weights"). So each packed weight keeps a
dense copy of the kernel's own values too, and `PackedWeight.mm` picks the form by the matmul's
row count. Unpacking the weights on the fly instead would cost 280 ms a forward there (2
threads; 430 ms with 1, `benchmarks/bench_dense_weights.py`), 5-8x the matmuls of a whole
batch-64 step, so the copy is kept: 2 bytes more per weight, 4 in float32 (the default model
holds 364 MB instead of 95 MB; `--quantization none` 269 MB). It is made at load, before the KV
pool is sized from the memory then free, and counted in `weight_bytes()` (start-up log, /metrics)
and by `pagedkv plan` (which assumes a bfloat16 model).

$PAGEDKV_DENSE_WEIGHTS: `auto` (default) measures the crossover once per CPU, torch build,
thread count and set of weight shapes (0.3-0.7 s there; cached as dense_weights.json,
calibration_cache.py: delete it to measure again); `0` keeps the packed weights only (least
memory); a number N uses the copies from N rows up.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch
from torch import Tensor, nn

from pagedkv.config import ConfigError, format_size, is_digits
from pagedkv.model.calibration_cache import cached, machine_key
from pagedkv.model.dtype_choice import MIN_BYTES
from pagedkv.model.moe import SparseMoE
from pagedkv.model.prepacked import dense_form, supported
from pagedkv.model.quant_linear import ACT_DTYPE, PackedWeight, linear

log = logging.getLogger("pagedkv")

ENV = "PAGEDKV_DENSE_WEIGHTS"
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)  # timed until the copy wins twice
REPEATS = 3  # rounds at least, MAX_ROUNDS at most
MAX_ROUNDS = 10
SETTLED = 0.98  # two rounds that lower no sum by 2% end the timing
PART_BYTES = 4 << 20  # the most of a copy one timed call reads
NEVER = 2**62  # dense_from when the packed kernel won every measured row count


def fixed_rows() -> int | None:
    """$PAGEDKV_DENSE_WEIGHTS: None for auto (measured), 0 for packed only, else N rows."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if not is_digits(value):
        raise ConfigError(
            f"{ENV} must be auto, 0 (packed weights only) or a row count, got {value!r}"
        )
    return int(value)


def keeps_copies() -> bool:
    """Whether packed weights come with their dense copy (what `pagedkv plan` counts)."""
    return fixed_rows() != 0


def packed_weights(model: nn.Module) -> list[PackedWeight]:
    """Each packed weight of the model once (a tied embedding and lm_head are one object), but a
    mixture's routed experts': each sees a few of a step's rows (a token's k of many experts: 4
    rows an expert at 64 sequences for Qwen3-30B-A3B), where the packed kernel wins, and copies of
    them all would hold the mixture again in bfloat16 (61 GB for Qwen3-30B-A3B). (A shared
    expert sees every row, as an MLP does: it keeps its copy.)"""
    routed = {id(e) for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts}
    found = {
        id(w): w
        for m in model.modules()
        if id(m) not in routed
        for w in vars(m).values()
        if isinstance(w, PackedWeight)
    }
    return list(found.values())


def copy_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """bfloat16 where oneDNN prepacks it (bf16 GEMMs are fast there, whatever the model's dtype);
    else the model's own float32, if that is what it runs in."""
    return torch.float32 if model_dtype == torch.float32 and not supported() else ACT_DTYPE


def add_dense_copies(model: nn.Module, model_dtype: torch.dtype) -> None:
    """Give every packed weight its dense copy and the row count from which matmuls use it."""
    rows = fixed_rows()
    weights = packed_weights(model)
    if rows == 0 or not weights:
        return
    dtype = copy_dtype(model_dtype)
    kinds: dict[str, list[PackedWeight]] = {}
    for w in weights:
        w.add_dense_copy(dtype)
        kinds.setdefault(w.packed_kind, []).append(w)
    for kind, group in kinds.items():
        start = rows if rows is not None else measured_crossover(kind, group, dtype)
        for w in group:
            w.dense_from = start
            if start >= NEVER:  # never faster here: the memory is worth more
                w.dense = None
        copies = sum(0 if w.dense is None else w.dense.nbytes for w in group)
        log.info(
            "%s: dense %s copies of %d matrices (%s) %s",
            kind,
            str(dtype).removeprefix("torch."),
            len(group),
            format_size(copies),
            f"used from {start} rows" if start < NEVER else "dropped: the packed kernel wins",
        )


def measured_crossover(kind: str, weights: list[PackedWeight], dtype: torch.dtype) -> int:
    """From how many rows the dense copies are faster than the packed kernel on these weights."""
    shapes = sorted({w.shape for w in weights})

    def measure() -> dict:
        t0 = time.monotonic()
        timings = time_both(sample(weights), dtype)
        entry = {"dense_from": crossover(timings), "timings": timings}
        log.info(
            "%s weights: packed / dense ms per pass %s, measured in %.2fs -> dense from %d rows",
            kind,
            ", ".join(f"{r}: {p * 1e3:.2f}/{d * 1e3:.2f}" for r, p, d in zip(*timings.values())),
            time.monotonic() - t0,
            entry["dense_from"],
        )
        return entry

    key = machine_key(kind, str(dtype).removeprefix("torch."), dense_form(), shapes)
    entry = cached("dense_weights.json", key, lambda e: _is_rows(e.get("dense_from")), measure)
    return int(entry["dense_from"])


def _is_rows(value: object) -> bool:
    return isinstance(value, int) and value >= 1


def sample(weights: list[PackedWeight]) -> list[PackedWeight]:
    """The first weights whose copies pass MIN_BYTES (more than a cache holds, as in a step),
    a big one cut into parts of PART_BYTES or less: a call of a millisecond or more is seldom
    left alone on a busy machine, and a pass of short calls is what a step of them costs."""
    taken, size = [], 0
    for w in weights:
        n, k = w.shape
        step = max(64, PART_BYTES // (2 * k) // 64 * 64)
        taken += [w.part(i, min(n, i + step)) for i in range(0, n, step)] if n > step else [w]
        size += n * k * 2
        if size >= MIN_BYTES:
            break
    return taken


def time_both(weights: list[PackedWeight], dtype: torch.dtype) -> dict[str, list]:
    """{"rows", "packed", "dense"}: seconds of a pass over `weights` in each form, for each of
    ROWS until the copy has won at two in a row."""
    out: dict[str, list] = {"rows": [], "packed": [], "dense": []}
    for rows in ROWS:
        xs = {  # (for the packed kernel, for the copy)
            k: (x.to(ACT_DTYPE), x.to(dtype))
            for k, x in ((k, torch.randn(rows, k)) for k in {w.shape[1] for w in weights})
        }
        for name, value in zip(("rows", "packed", "dense"), (rows, *_best_pass(weights, xs))):
            out[name].append(value)
        last_two = list(zip(out["packed"], out["dense"]))[-2:]
        if len(last_two) == 2 and all(d < p for p, d in last_two):
            break
    return out


def _best_pass(
    weights: list[PackedWeight], xs: dict[int, tuple[Tensor, Tensor]]
) -> tuple[float, float]:
    """A pass's seconds, packed and dense, as the sum of each matmul's best time. Each is timed
    alone, right after the same matrix in the other form, over at least REPEATS rounds and until
    two rounds in a row improve neither sum by SETTLED: on a busy machine a pause spoils one
    sample, not a pass, and a slow spell only adds rounds."""
    best = [[math.inf, math.inf] for _ in weights]
    sums, idle = (math.inf, math.inf), 0
    for round_ in range(MAX_ROUNDS + 1):  # round 0 warms up
        for w, times in zip(weights, best):
            (x, x_copy), copy = xs[w.shape[1]], w.dense
            assert copy is not None  # (added before timing)
            for form in (0, 1):
                t0 = time.perf_counter()
                w.packed_mm(x) if form == 0 else linear(x_copy, copy)
                if round_:
                    times[form] = min(times[form], time.perf_counter() - t0)
        new = (sum(t[0] for t in best), sum(t[1] for t in best))
        idle = idle + 1 if all(n > SETTLED * s for n, s in zip(new, sums)) else 0
        if round_ >= REPEATS and idle >= 2:
            return new
        sums = new
    return sums


def crossover(timings: dict[str, list]) -> int:
    """The smallest timed row count from which the copy was faster at every larger one timed
    (NEVER if it lost at the largest)."""
    start = NEVER
    for rows, packed, dense in reversed(list(zip(*timings.values()))):
        if dense >= packed:
            break
        start = rows
    return start

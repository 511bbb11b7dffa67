"""`--dtype auto` on CPU, by measurement: time this model's matmuls in float32 and bfloat16,
keep the faster.

A flag list cannot tell: without AVX-512 BF16, bfloat16 weights still win a
batch-1 step (half the bytes, and a step is bound by reading the weights) but
lose batched steps (no native bf16 dot product: oneDNN converts, and compute
dominates). So the calibration times one decoder layer's worth of distinct
weights of this model's shapes (more than a cache holds, like a real step) at
batch 1 and at a batched step, and keeps the dtype with the lower geometric
mean of per-token time over the two. It costs about a second, once: the
verdict is cached per CPU, torch build, thread count and model shape in
$PAGEDKV_EXT_DIR (or ~/.cache/pagedkv) as dtype.json (calibration_cache.py).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from pagedkv.model.calibration_cache import cached, machine_key
from pagedkv.model.config import LlamaConfig
from pagedkv.model.prepacked import dense_form, prepack
from pagedkv.model.quant_linear import linear

log = logging.getLogger("pagedkv")

CANDIDATES = (torch.float32, torch.bfloat16)
BATCHED = 32  # a busy decode step's batch
MIN_BYTES = 64 << 20  # float32 weights timed per trial: past the last-level cache of a server CPU
REPEATS = 3


def layer_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections: q, k, v, o, gate, up, down (an expert's,
    where experts replace the MLP)."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size or cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def _time_per_token(shapes: list[tuple[int, int]], dtype: torch.dtype, batch: int) -> float:
    """Seconds per token of one pass over enough distinct weights of these shapes.

    The best of REPEATS passes."""
    per_layer = sum(o * i for o, i in shapes) * 4
    layers = max(1, math.ceil(MIN_BYTES / per_layer))
    weights = [  # in the form the model multiplies by (bfloat16 prepacked where it can be)
        prepack(torch.empty(s, dtype=dtype).uniform_(-0.05, 0.05))
        for _ in range(layers)
        for s in shapes
    ]
    inputs = {i: torch.randn(batch, i).to(dtype) for _, i in shapes}
    best = math.inf
    for _ in range(REPEATS + 1):  # the first pass warms up the matmul library
        t0 = time.perf_counter()
        for w in weights:
            linear(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return best / batch


def measure(shapes: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    """{dtype: {"1": s/token, "32": s/token}} for each candidate."""
    return {
        str(dt).removeprefix("torch."): {
            str(b): _time_per_token(shapes, dt, b) for b in (1, BATCHED)
        }
        for dt in CANDIDATES
    }


def pick(timings: dict[str, dict[str, float]]) -> str:
    """The dtype with the lowest geometric mean of per-token time over the measured batch sizes."""
    return min(timings, key=lambda dt: math.prod(timings[dt].values()))


def choose_cpu_dtype(cfg: LlamaConfig) -> torch.dtype:
    """Measured once per (CPU, torch, threads, model shape), then read from the cache."""
    shapes = layer_shapes(cfg)

    def measured() -> dict:
        t0 = time.monotonic()
        timings = measure(shapes)
        entry = {"dtype": pick(timings), "timings": timings}
        log.info(
            "--dtype auto: measured %s in %.1fs -> %s",
            _describe(timings),
            time.monotonic() - t0,
            entry["dtype"],
        )
        return entry

    entry = cached(
        "dtype.json",
        machine_key(dense_form(), shapes),
        lambda e: e.get("dtype") in ("float32", "bfloat16"),
        measured,
    )
    return getattr(torch, entry["dtype"])


def _describe(timings: dict[str, dict[str, float]]) -> str:
    return ", ".join(
        f"{dt} " + "/".join(f"{v * 1e6:.0f}" for v in t.values()) + " us/token (batch 1/32)"
        for dt, t in timings.items()
    )

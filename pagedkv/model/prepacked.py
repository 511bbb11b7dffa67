"""bfloat16 weights reordered once into oneDNN's blocked layout, for every dense matmul.

`F.linear` on a plain bfloat16 weight lets oneDNN reorder that weight into its blocked form on
every call: on a 2-core AVX-512 BF16 EPYC a whole decode step of the default model's matmuls
takes 12.1 ms at 1 row and 31.6 ms at 64 rows that way, against 9.4 and 26.8 ms with weights
reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`, the op torch's own inductor
uses for frozen CPU weights; benchmarks/bench_prepacked.py, BENCHMARKS.md "Prepacked weights").
The results are the same bits as `F.linear`'s (the same oneDNN kernel does the arithmetic), so
nothing an output depends on changes. vLLM's CPU backend does the same with its own binding.

Only bfloat16: oneDNN's float32 matmul is faster prepacked too, but not bit-equal to torch's
(MKL) `F.linear`, which `--dtype float32` keeps so that outputs equal transformers. oneDNN's
bfloat16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere `supported()` is False
and weights stay plain. $PAGEDKV_PREPACK=0 keeps them plain anywhere (to compare).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger("pagedkv")

ENV = "PAGEDKV_PREPACK"


@functools.cache
def supported() -> bool:
    """Whether this CPU and torch build prepack bfloat16 weights, with F.linear's exact results."""
    if os.environ.get(ENV, "1").strip() == "0" or not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    try:
        same = torch.equal(PrepackedWeight.of(w).mm(x), F.linear(x, w))
    except (RuntimeError, AttributeError) as e:  # no such op, or the CPU lacks what it needs
        log.info("bfloat16 weights stay plain: oneDNN cannot prepack them here (%s)", e)
        return False
    if not same:
        log.info("bfloat16 weights stay plain: oneDNN's prepacked matmul differs from F.linear")
    return same


@dataclass
class PrepackedWeight:
    """A [N, K] bfloat16 weight in oneDNN's blocked layout: `mm(x)` is F.linear(x, w)."""

    packed: Tensor  # an opaque mkldnn tensor
    shape: tuple[int, int]  # (N, K)

    @classmethod
    def of(cls, w: Tensor) -> PrepackedWeight:
        n, k = w.shape
        # (the second argument is a batch-size hint; measured: no effect on speed at 1-1024 rows)
        return cls(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1), (n, k))

    def mm(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def prepack(w: Tensor) -> Tensor | PrepackedWeight:
    """w prepacked when it is a bfloat16 matrix and this machine supports it, else w itself."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.device.type != "cpu" or not supported():
        return w
    return PrepackedWeight.of(w)


def dense_form() -> str:
    """How bfloat16 matmuls run here, for the keys of start-up measurements that timed them."""
    return "prepacked" if supported() else "plain"

"""bfloat16 weights reordered once at load, for every dense matmul.

`F.linear` on a plain bfloat16 weight lets oneDNN reorder that weight into its blocked form on
every call. Two forms do the reordering once:

- "pairs" (CPUs with AVX512_BF16, when the C++ kernels are built): panels of 32 output columns
  with consecutive k pairs side by side, multiplied by our own GEMM (csrc/gemm.cpp), which
  prefetches each panel while it multiplies the one before. On a 2-core AVX-512 BF16 EPYC a
  decode step of the default model's matmuls takes 24.7 ms at 64 rows against oneDNN's 30.8
  (prepacked) and 40.2 (plain), 8.3 against 11.9 and 19.6 at one row (BENCHMARKS.md "A bf16
  GEMM of our own"). Its float32 sums run in another order than oneDNN's, so a result may differ
  from F.linear's by a bfloat16 rounding step; the probe at start-up checks that bound.
- "onednn": oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op torch's
  inductor uses for frozen CPU weights), the same bits as `F.linear`
  (benchmarks/bench_prepacked.py times the three). Needs AVX-512 (BW, VL, DQ) or
  AVX-NE-CONVERT.

Only bfloat16: oneDNN's float32 matmul is faster prepacked too, but not bit-equal to torch's
(MKL) `F.linear`, which `--dtype float32` keeps so that outputs equal transformers. Where neither
form runs, weights stay plain. $PAGEDKV_PREPACK picks: 0 (plain), onednn, or unset (the best
this machine runs).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv import native

log = logging.getLogger("pagedkv")

ENV = "PAGEDKV_PREPACK"
PANEL = 32  # output columns of a "pairs" panel (csrc/gemm.cpp)


def _setting() -> str:
    setting = os.environ.get(ENV, "").strip().lower()
    if setting not in ("", "1", "0", "onednn"):
        raise ValueError(f"{ENV}={setting!r}: want 0, onednn, or unset")
    return setting


@functools.cache
def form() -> str:
    """How bfloat16 weights are kept here: "pairs", "onednn" or "plain" (module docstring)."""
    setting = _setting()
    if setting == "0":
        return "plain"
    if setting != "onednn" and _probe("pairs"):
        return "pairs"
    return "onednn" if _onednn_runs() else "plain"


def supported() -> bool:
    """Whether bfloat16 weights are prepacked here (in either form). Asks oneDNN first, which
    runs wherever our GEMM does, so that `pagedkv plan` need not build the C++ kernels."""
    return _setting() != "0" and (_onednn_runs() or form() == "pairs")


@functools.cache
def _onednn_runs() -> bool:
    return torch.backends.mkldnn.is_available() and _probe("onednn")


def _probe(kind: str) -> bool:
    """Whether `kind` runs here and agrees with F.linear: bit for bit (onednn), or within one
    bfloat16 rounding step of each result (pairs, whose sums run in another order)."""
    if kind == "pairs":
        lib = native.library()
        if lib is None or not lib.bf16_gemm:
            return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(13, 96, generator=gen).to(torch.bfloat16)
    try:
        got, want = PrepackedWeight.of(w, kind).mm(x).float(), F.linear(x, w).float()
    except (RuntimeError, AttributeError, native.KernelError) as e:  # no such op, or CPU lacks it
        log.info("bfloat16 weights: %s prepacking does not run here (%s)", kind, e)
        return False
    step = want.abs().clamp_min(2**-100) * 2**-7  # a bfloat16 rounding step of each result
    same = torch.equal(got, want) if kind == "onednn" else bool(((got - want).abs() <= step).all())
    if not same:
        log.warning("bfloat16 weights: %s prepacking disagrees with F.linear; not used", kind)
    return same


@dataclass
class PrepackedWeight:
    """A [N, K] bfloat16 weight in one of the prepacked forms: `mm(x)` is F.linear(x, w)."""

    packed: Tensor  # pairs: the N K values in panels (gemm.cpp); onednn: an opaque mkldnn tensor
    shape: tuple[int, int]  # (N, K)
    kind: str  # "pairs" or "onednn"

    @classmethod
    def of(cls, w: Tensor, kind: str) -> PrepackedWeight:
        n, k = w.shape
        w = w.contiguous()
        if kind == "pairs":  # panels of PANEL rows of w (the last may have fewer), [k/2, rows, 2]
            parts = w.split(PANEL)
            packed = torch.cat([p.view(-1, k // 2, 2).transpose(0, 1).reshape(-1) for p in parts])
            return cls(packed, (n, k), kind)
        # (the second argument is a batch-size hint; measured: no effect on speed at 1-1024 rows)
        return cls(torch.ops.mkldnn._reorder_linear_weight(w, 1), (n, k), kind)

    # pairs: gemm_bf16's parameters with the weight's fields filled (mm sets the others; a model
    # runs one forward at a time, so one struct per weight serves every call)
    _params: ctypes.Structure | None = field(default=None, init=False, repr=False, compare=False)

    def mm(self, x: Tensor) -> Tensor:
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        n, k = self.shape
        if x.dim() != 2:
            return self.mm(x.reshape(-1, k)).view(*x.shape[:-1], n)
        if x.dtype != torch.bfloat16:
            raise native.KernelError(f"gemm_bf16: x must be bfloat16, got {x.dtype}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self._params is None:
            self._params = native.library().params(  # type: ignore[union-attr] # (form() found it)
                "gemm_bf16", x=0, x_stride=0, w=self.packed.data_ptr(), out=0, out_stride=n,
                rows=0, n=n, k=k, threads=1,
            )  # fmt: skip
        return run_gemm("gemm_bf16", self._params, x, n)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def run_gemm(kernel: str, params: ctypes.Structure, x: Tensor, n: int) -> Tensor:
    """[rows, n] bfloat16: x [rows, k] (bfloat16, unit stride) times the weight whose fields
    `params` of a gemm.cpp kernel hold; sets the others."""
    lib = native.library()
    assert lib is not None
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    params.x, params.x_stride, params.out = x.data_ptr(), x.stride(0), out.data_ptr()
    params.rows, params.threads = x.shape[0], torch.get_num_threads()
    lib.run(kernel, params)
    return out


def prepack(w: Tensor) -> Tensor | PrepackedWeight:
    """w prepacked when it is a bfloat16 matrix and this machine supports it, else w itself."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.device.type != "cpu":
        return w
    kind = form()
    if kind == "plain" or (kind == "pairs" and w.shape[1] % 2):  # (the kernel takes k in pairs)
        return w
    return PrepackedWeight.of(w, kind)


def dense_form() -> str:
    """How bfloat16 matmuls run here, for the keys of start-up measurements that timed them."""
    return {"pairs": "pairs", "onednn": "prepacked", "plain": "plain"}[form()]

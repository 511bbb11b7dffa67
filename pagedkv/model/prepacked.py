"""Matmul weights reordered once at load, for every dense matmul.

`F.linear` on a plain bfloat16 weight lets oneDNN reorder that weight into its blocked form on
every call, and MKL's float32 `sgemm` reaches ~60% of the FMA rate at a decode step's rows (on
AMD CPUs it takes the AVX2 path even where AVX-512 runs). The forms, chosen once per process:

- bfloat16, "pairs" (CPUs with AVX512_BF16, when the C++ kernels are built): panels of 32
  output columns with consecutive k pairs side by side, multiplied by our own GEMM
  (csrc/gemm.cpp), which prefetches each panel while it multiplies the one before. On a 2-core
  AVX-512 BF16 EPYC a decode step of the default model's matmuls takes 24.7 ms at 64 rows
  against oneDNN's 30.8 (prepacked) and 40.2 (plain), 8.3 against 11.9 and 19.6 at one row
  (BENCHMARKS.md "A bf16 GEMM of our own"). Its float32 sums run in another order than
  oneDNN's, so a result may differ from F.linear's by a bfloat16 rounding step; the probe at
  start-up checks that bound. On CPUs with AMX the same panels are AMX's tile layout, and from
  8 rows on the GEMM multiplies tiles: at 64 rows a step of the default model's matmuls takes
  16 ms against oneDNN's 17 and the AVX-512 kernel's 77 on a 2-core Xeon with AMX (BENCHMARKS.md
  "Session 40"); $PAGEDKV_AMX=0 keeps the AVX-512 kernel.
- bfloat16, "onednn": oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the
  op torch's inductor uses for frozen CPU weights), the same bits as `F.linear` where oneDNN
  picks the same kernel for both (on AMX CPUs it may not; benchmarks/bench_prepacked.py times
  the three). Needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT.
- float32, "panels" (AVX-512 and AVX2 builds of the kernels): panels of 2 vectors of output
  columns, multiplied by gemm.cpp's float32 GEMM at ~90% of the FMA rate: 1.55x MKL at 64
  rows with AVX2, 2.6x with AVX-512 (BENCHMARKS.md "A float32 GEMM of our own"). Its sums too
  run in another order, so results differ from F.linear's by float32 rounding (the probe
  bounds them against the float64 product). Not on NEON (not measured) nor the portable build
  (slower than MKL).

Where none runs, weights stay plain. $PAGEDKV_PREPACK picks: 0 (plain), onednn (oneDNN's form
for bfloat16, plain float32: the libraries' matmuls), or unset (the best this machine runs).
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


def setting() -> str:
    """$PAGEDKV_PREPACK, checked."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting not in ("", "1", "0", "onednn"):
        raise ValueError(f"{ENV}={setting!r}: want 0, onednn, or unset")
    return setting


@functools.cache
def form() -> str:
    """How bfloat16 weights are kept here: "pairs", "onednn" or "plain" (module docstring)."""
    chosen = setting()
    if chosen == "0":
        return "plain"
    if chosen != "onednn" and _probe("pairs"):
        return "pairs"
    return "onednn" if _onednn_runs() else "plain"


@functools.cache
def float32_form() -> str:
    """How float32 weights are kept here: "panels" or "plain" (module docstring)."""
    lib = _own_kernels()
    runs = lib is not None and lib.isa in ("avx512", "avx2") and _probe("panels")
    return "panels" if runs else "plain"


@functools.cache
def int4_form() -> str:
    """How 4-bit weights are kept here: "panels" for gemm.cpp's gemm_int4 (AVX512_BF16 builds; and
    AVX2 builds, where it unpacks the codes into float32 FMAs: 1.1-1.4x torch's int4 kernel at
    the 1 and 5 rows of a single stream and its verify steps, about even at 2-4, BENCHMARKS.md
    "4-bit weights on AVX2"), else "aten" (torch's kernel)."""
    lib = _own_kernels()
    return "panels" if form() == "pairs" or (lib is not None and lib.isa == "avx2") else "aten"


def _own_kernels() -> native.Library | None:
    """The C++ library, unless $PAGEDKV_PREPACK asks for the libraries' matmuls (0 or onednn)."""
    return None if setting() in ("0", "onednn") else native.library()


def supported() -> bool:
    """Whether bfloat16 weights are prepacked here (in either form). Asks oneDNN first, which
    runs wherever our GEMM does, so that `pagedkv plan` need not build the C++ kernels."""
    return setting() != "0" and (_onednn_runs() or form() == "pairs")


@functools.cache
def _onednn_runs() -> bool:
    return torch.backends.mkldnn.is_available() and _probe("onednn")


def _probe(kind: str) -> bool:
    """Whether `kind` runs here and agrees with F.linear: bit for bit (onednn), within one
    bfloat16 rounding step of each result (pairs), or within float32 rounding of the float64
    product (panels); both our GEMMs sum in another order."""
    if kind in ("pairs", "panels"):
        lib = native.library()
        if lib is None or (kind == "pairs" and not lib.bf16_gemm):
            return False
    dtype = torch.float32 if kind == "panels" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=gen).to(dtype)
    x = torch.randn(13, 96, generator=gen).to(dtype)
    try:
        got = PrepackedWeight.of(w, kind).mm(x).double()
    except (RuntimeError, AttributeError, native.KernelError) as e:  # no such op, or CPU lacks it
        log.info("%s weights: %s prepacking does not run here (%s)", dtype, kind, e)
        return False
    if kind == "panels":  # against the exact product: k roundings of float32 sums at most
        bound = (x.double().abs() @ w.double().abs().T) * w.shape[1] * 2**-24
        same = bool(((got - x.double() @ w.double().T).abs() <= bound).all())
    else:
        want = F.linear(x, w).double()
        step = want.abs().clamp_min(2**-100) * 2**-7  # a bfloat16 rounding step of each result
        close = bool(((got - want).abs() <= step).all())
        same = torch.equal(got, want) if kind == "onednn" else close
    if not same:
        log.warning("%s weights: %s prepacking disagrees with F.linear; not used", dtype, kind)
    return same


@dataclass
class GemmCall:
    """A gemm.cpp kernel bound to one packed weight: the library it was packed for (a panel's
    width is that build's) and the kernel's parameter struct with the weight's fields filled.
    A model runs one forward at a time, so one struct per weight serves every call."""

    lib: native.Library
    kernel: str
    params: ctypes.Structure
    n: int  # output columns

    @classmethod
    def of(cls, kernel: str, n: int, **weight: object) -> GemmCall:
        lib = native.library()
        if lib is None:
            raise native.KernelError(f"{kernel}: the C++ kernels are not built here")
        fields = dict(x=0, x_stride=0, out=0, out_stride=n, rows=0, n=n, threads=1)
        return cls(lib, kernel, lib.params(kernel, **fields, **weight), n)

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """[rows, n] in x's dtype for x [rows, k] (unit stride), in `out` when it fits."""
        out = native.output(out, (x.shape[0], self.n), x.dtype)
        p = self.params
        p.x, p.x_stride, p.out = x.data_ptr(), x.stride(0), out.data_ptr()
        p.rows, p.threads = x.shape[0], torch.get_num_threads()
        self.lib.run(self.kernel, p)
        return out


# our GEMMs: form -> (kernel, dtype of x and W)
_KERNELS = {"pairs": ("gemm_bf16", torch.bfloat16), "panels": ("gemm_f32", torch.float32)}


@dataclass
class PrepackedWeight:
    """A [N, K] weight in one of the prepacked forms: `mm(x)` is F.linear(x, w)."""

    packed: Tensor  # pairs / panels: the N K values in panels (gemm.cpp); onednn: opaque mkldnn
    shape: tuple[int, int]  # (N, K)
    kind: str  # "pairs" or "onednn" (bfloat16), "panels" (float32)
    call: GemmCall | None = field(default=None, repr=False, compare=False)  # pairs / panels

    @classmethod
    def of(cls, w: Tensor, kind: str) -> PrepackedWeight:
        n, k = w.shape
        w = w.contiguous()
        if kind == "onednn":  # (the second argument is a batch-size hint; measured: no effect)
            return cls(torch.ops.mkldnn._reorder_linear_weight(w, 1), (n, k), kind)
        if kind == "pairs":  # panels of PANEL rows of w (the last may have fewer), [k/2, rows, 2]
            parts = w.split(PANEL)
            packed = torch.cat([p.view(-1, k // 2, 2).transpose(0, 1).reshape(-1) for p in parts])
        else:  # panels of c rows of w, [k, c], the last padded with zero rows
            lib = native.library()
            if lib is None:
                raise native.KernelError("gemm_f32: the C++ kernels are not built here")
            c = 2 * lib.vector_width
            packed = F.pad(w, (0, 0, 0, -n % c)).view(-1, c, k).transpose(1, 2).reshape(-1)
        call = GemmCall.of(_KERNELS[kind][0], n, w=packed.data_ptr(), k=k)
        return cls(packed, (n, k), kind, call)

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x @ W.T; our GEMMs write it into `out` when it fits (GemmCall), oneDNN anywhere."""
        if self.call is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        n, k = self.shape
        if x.dim() != 2:
            return self.mm(x.reshape(-1, k)).view(*x.shape[:-1], n)
        kernel, dtype = _KERNELS[self.kind]
        if x.dtype != dtype:
            raise native.KernelError(f"{kernel}: x must be {dtype}, got {x.dtype}")
        return self.call(x if x.stride(-1) == 1 else x.contiguous(), out)

    def rows(self, ids: list[int]) -> Tensor:
        """Rows of W, float32, read back out of the packed form (oneDNN's opaque one by
        multiplying unit vectors: exact, each output one weight times 1)."""
        n, k = self.shape
        if self.kind == "pairs":  # panel p: [k/2, its rows, 2]
            picked = []
            for i in ids:
                p, r = divmod(i, PANEL)
                width = min(PANEL, n - p * PANEL)
                panel = self.packed[p * PANEL * k : (p * PANEL + width) * k]
                picked.append(panel.view(k // 2, width, 2)[:, r].reshape(k))
            return torch.stack(picked).float()
        if self.kind == "panels":  # panel p: [k, c]
            lib = native.library()
            assert lib is not None  # (it packed this weight)
            c = 2 * lib.vector_width
            panels = self.packed.view(-1, k, c)
            return panels[[i // c for i in ids], :, [i % c for i in ids]].float()
        eye = torch.eye(k, dtype=torch.bfloat16)
        cols = torch.cat([self.mm(eye[at : at + 256])[:, ids] for at in range(0, k, 256)])
        return cols.T.float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def prepack(w: Tensor) -> Tensor | PrepackedWeight:
    """w prepacked when it is a bfloat16 or float32 matrix and this machine has a form for it,
    else w itself."""
    if w.dim() != 2 or w.device.type != "cpu":
        return w
    if w.dtype == torch.float32:
        return PrepackedWeight.of(w, "panels") if float32_form() == "panels" else w
    if w.dtype != torch.bfloat16:
        return w
    kind = form()
    if kind == "plain" or (kind == "pairs" and w.shape[1] % 2):  # (the kernel takes k in pairs)
        return w
    return PrepackedWeight.of(w, kind)


def dense_form() -> str:
    """How bfloat16 and float32 matmuls run here, for the keys of start-up measurements that
    timed them."""
    bf16 = {"pairs": "pairs", "onednn": "prepacked", "plain": "plain"}[form()]
    return f"{bf16}, float32 {float32_form()}"

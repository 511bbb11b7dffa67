"""Weights kept at low precision, and the one `linear(x, w)` the forward calls.

Two quantized holders, multiplied by packed CPU kernels that want bfloat16
activations and scales (torch's float32 versions are 20-40x slower, measured),
and plain tensors:

- `Int4Weight`: 4 bits per weight, a scale and a zero per group of 32 along K
  (w = (q - 8) * scale + zero), multiplied by our gemm_int4 (csrc/gemm.cpp) on
  CPUs with AVX512_BF16, else by `aten._weight_int4pack_mm_for_cpu`. GGUF's
  Q4_0 (d, zero -8d), Q4_1 (d, m) and Q4_K (per-32 sub-block d*sc, -dmin*m) map
  onto it with the same 4-bit codes; only the scales and zeros are rounded from
  float16 to bfloat16 (a relative error <= 2^-9 of each).
- `Int8Weight`: int8 per output channel with one scale per row
  (`aten._weight_int8pack_mm`). Used for `--quantization int8`, and under
  gguf for the embedding and lm_head in types no torch kernel runs as they are
  (Q8_0's per-32 scales, Q6_K's 6-bit codes with per-16 scales): re-quantized
  per row, which adds at most half a step of rowmax/127 to each weight.
- plain tensors (`--quantization none`; under gguf, Q8_0/Q6_K matrices other
  than those two and tensors of other types, dequantized to the model's dtype).

Both holders may also keep a dense copy of the kernel's own weight values
(`PackedWeight`; bfloat16, or float32 where bf16 GEMMs are slow), which matmuls
of many rows use (dense_weights.py).

`Blocks` is the loader's form of a GGUF tensor before the kernel layout is
chosen: codes, scales and zeros per group, so q/k rows can be permuted and
q/k/v parts concatenated before packing (the packed layout cannot be cut).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from torch import Tensor, nn

from pagedkv import native
from pagedkv.model.prepacked import GemmCall, PrepackedWeight, int4_form, prepack

ACT_DTYPE = torch.bfloat16  # what the packed kernels take and return
INT4_GROUPS = (32, 64, 128)  # group sizes aten's int4 CPU kernel accepts
_BLOCK_N = 64  # the rows of a block in aten's int4 layout, at most (_int4_layout)


class PackedWeight:
    """A weight for torch's packed kernels, with an optional dense copy of the same values.

    Those kernels beat a dense GEMM on few rows (fewer bytes read) but lose on many (they do not
    block for compute), so a matmul of `dense_from` rows or more uses the copy; dense_weights.py
    adds it and measures the crossover. Both forms hold the kernel's own weight values (rounded
    to bfloat16 once in the copy), so the two paths agree to float rounding.
    """

    shape: tuple[int, int]  # (N, K)
    dense: Tensor | PrepackedWeight | None = None  # [N, K], bf16 prepacked where it can be
    dense_dtype: torch.dtype = ACT_DTYPE  # the copy's (dense_weights.copy_dtype)
    dense_from: int = 1  # rows

    def mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        n, k = self.shape
        dense = self.dense
        if dense is not None and x.numel() >= self.dense_from * k:  # (few torch calls: a step
            if x.dtype == self.dense_dtype:  # makes 121 of them)
                return linear(x, dense, out)
            return linear(x.to(self.dense_dtype), dense).to(x.dtype)
        rows = x.reshape(-1, k)
        if self.takes(x.dtype):
            y = self.packed_mm(rows.contiguous(), out)
        else:
            y = self.packed_mm(rows.to(ACT_DTYPE).contiguous()).to(x.dtype)
        return y.reshape(*x.shape[:-1], n)

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether the packed kernel takes activations of this dtype as they are (others go
        through ACT_DTYPE)."""
        return dtype == ACT_DTYPE

    def packed_mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [T, K] in a dtype it `takes` -> [T, N] in the same, through the packed kernel (ours
        writes into `out` when it fits, torch's into a new tensor)."""
        raise NotImplementedError

    def dequantize(self) -> Tensor:
        """W [N, K] float32, as the kernel computes it."""
        raise NotImplementedError

    def add_dense_copy(self, dtype: torch.dtype = ACT_DTYPE) -> None:
        self.dense = prepack(self.dequantize().to(dtype).contiguous())
        self.dense_dtype = dtype

    def part(self, start: int, stop: int) -> PackedWeight:
        """Output rows start:stop (multiples of 64) as a weight of their own, on the same
        storage, copy included: a big matrix timed in short calls (dense_weights.py)."""
        part = self._rows(start, stop)
        if self.dense is not None:  # (a prepacked copy cannot be cut: the part makes its own)
            part.add_dense_copy(self.dense_dtype)
        part.dense_from = self.dense_from
        return part

    def _rows(self, start: int, stop: int) -> PackedWeight:
        raise NotImplementedError

    @property
    def packed_nbytes(self) -> int:
        raise NotImplementedError

    @property
    def packed_kind(self) -> str:
        """Which packed kernel runs it (the key of its measured crossover)."""
        return type(self).__name__

    @property
    def nbytes(self) -> int:
        return self.packed_nbytes + (0 if self.dense is None else self.dense.nbytes)


@functools.cache
def _int4_layout() -> tuple[int, Tensor, Tensor]:
    """aten's int4 CPU layout: rows in blocks of B, each block [K, B/2] bytes; returns B and the
    byte and bit shift of each row of a block. Found by packing a probe, since the layout follows
    the kernel torch dispatches to (AVX-512: B = 64, rows j and j + 32 share a byte; AVX2 and the
    default: B = 32, rows 2i and 2i + 1)."""
    j = torch.arange(_BLOCK_N, dtype=torch.int32)
    probe = torch.zeros(_BLOCK_N, 32, dtype=torch.int32)
    probe[:, 0], probe[:, 1] = j % 16, j // 16  # row j's id in its codes of columns 0 and 1
    raw = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).flatten()
    for rows in (64, 32, 16):
        cols = raw.view(_BLOCK_N // rows, 32, rows // 2)[:, :2]  # [blocks, columns 0-1, bytes]
        nibbles = torch.stack([cols & 15, cols >> 4], dim=-1).long()  # [blocks, 2, bytes, 2]
        found = nibbles[:, 0] + 16 * nibbles[:, 1] - torch.arange(0, _BLOCK_N, rows)[:, None, None]
        if (found == found[0]).all() and sorted(found[0].flatten().tolist()) == list(range(rows)):
            place = torch.empty(rows, dtype=torch.long)
            place[found[0].flatten()] = torch.arange(rows)
            return rows, place // 2, (place % 2 * 4).to(torch.uint8)
    raise RuntimeError("unknown layout of torch's packed int4 CPU weights")


@dataclass
class Int4Weight(PackedWeight):
    """4-bit codes with a bf16 scale and zero per group: w = (q - 8) * scale + zero.

    Two layouts of the same bytes: aten's (its CPU int4 kernel), or, where ours runs
    (prepacked.int4_form(): AVX512_BF16 and AVX2 builds), panels of 32 output rows for
    csrc/gemm.cpp's gemm_int4, 1.3-2.2x faster than aten's at few rows with AVX512_BF16 and
    1.2-1.4x at a single stream's 1 and 5 rows with AVX2 (BENCHMARKS.md "A bf16 GEMM of our
    own", "4-bit weights on AVX2")."""

    packed: Tensor  # aten: uint8 [N, K/2] (N a multiple of 64); panels: uint8 [N/32, K/2, 32]
    scales_zeros: Tensor  # aten: bfloat16 [K/group, N, 2]; panels: [N/32, K/group, 2, 32]
    group: int
    shape: tuple[int, int]  # (N, K)
    panels: bool = False
    _call: GemmCall | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.panels:  # (bound now: the library packed for, whatever native.library() says later)
            n, k = self.shape
            self._call = GemmCall.of(
                "gemm_int4", n, codes=self.packed.data_ptr(), scales=self.scales_zeros.data_ptr(),
                k=k, group=self.group, dtype=native.DTYPES[ACT_DTYPE],
            )  # fmt: skip

    def takes(self, dtype: torch.dtype) -> bool:
        """Ours also takes float32 (a float32 model: no rounding to bf16 on the way in or out,
        no conversions around the call)."""
        return dtype == ACT_DTYPE or (self._call is not None and dtype == torch.float32)

    def packed_mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if self._call is None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group, self.scales_zeros
            )
        self._call.params.dtype = native.DTYPES[x.dtype]
        return self._call(x, out)

    @property
    def packed_kind(self) -> str:
        return "Int4Weight (panels)" if self.panels else "Int4Weight"

    def _codes_and_scales(self, ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Codes [T, K] (rows `ids` of W, None: all) and their scales and zeros [T, K/group]."""
        n, k = self.shape
        if self.panels:
            sz = self.scales_zeros  # [N/32, G, 2, 32]
            if ids is None:
                lo_hi = torch.stack([self.packed & 15, self.packed >> 4], dim=2)  # [P, K/2, 2, 32]
                raw = lo_hi.view(-1, k // 2, 2, 16, 2).permute(0, 2, 3, 1, 4).reshape(n, k)
                scale, zero = sz.permute(2, 0, 3, 1).reshape(2, n, -1).float()
                return raw, scale, zero
            panel, col = ids // 32, ids % 32
            at = (2 * (col % 16))[:, None] + torch.arange(2)  # the column's two bytes a k pair
            pairs = self.packed[panel].gather(2, at[:, None, :].expand(-1, k // 2, 2))
            raw = (pairs >> (4 * (col // 16)).to(torch.uint8)[:, None, None]) & 15
            scale, zero = sz[panel, :, :, col].permute(2, 0, 1).float()  # [2, T, G]
            return raw.reshape(-1, k), scale, zero
        rows, byte, shift = _int4_layout()
        blocks = self.packed.view(n // rows, k, rows // 2)
        if ids is None:
            raw = blocks[:, :, byte].transpose(1, 2).reshape(n, k)  # [N/B, K, B] -> [N, K]
            shifts = shift.repeat(n // rows)
            scale, zero = self.scales_zeros.float().unbind(-1)  # [K / group, N]
        else:
            raw = blocks[ids // rows, :, byte[ids % rows]]  # [T, K] bytes
            shifts = shift[ids % rows]
            scale, zero = self.scales_zeros[:, ids].float().unbind(-1)
        return (raw >> shifts[:, None]) & 15, scale.t(), zero.t()

    def _values(self, ids: Tensor | None) -> Tensor:
        """Rows `ids` of W (None: all) as float32 [T, K]."""
        k = self.shape[1]
        raw, scale, zero = self._codes_and_scales(ids)
        q = raw.float().view(-1, k // self.group, self.group) - 8
        return (q * scale[..., None] + zero[..., None]).view(-1, k)

    def _rows(self, start: int, stop: int) -> Int4Weight:
        if self.panels:
            rows = slice(start // 32, stop // 32)
            return Int4Weight(
                self.packed[rows],
                self.scales_zeros[rows],
                self.group,
                (stop - start, self.shape[1]),
                True,
            )
        sz = self.scales_zeros[:, start:stop].contiguous()
        return Int4Weight(self.packed[start:stop], sz, self.group, (stop - start, self.shape[1]))

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Embedding lookup: only the looked-up rows are unpacked."""
        return self._values(ids).to(dtype)

    def dequantize(self) -> Tensor:
        return self._values(None)

    @property
    def packed_nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


@dataclass
class Int8Weight(PackedWeight):
    q: Tensor  # int8 [N, K]
    scale: Tensor  # bfloat16 [N]
    shape: tuple[int, int] = field(init=False)

    def __post_init__(self) -> None:
        n, k = self.q.shape
        self.shape = (n, k)

    @classmethod
    def quantize(cls, w: Tensor) -> Int8Weight:
        """Symmetric per-row int8: scale = max|row| / 127."""
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(ACT_DTYPE)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale.contiguous())

    def packed_mm(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def _rows(self, start: int, stop: int) -> Int8Weight:
        return Int8Weight(self.q[start:stop], self.scale[start:stop])

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Embedding lookup: only the looked-up rows are dequantized."""
        return F.embedding(ids, self.q).to(dtype) * self.scale[ids].to(dtype)[..., None]

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @property
    def packed_nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


QuantWeight = Int4Weight | Int8Weight  # (PackedWeight's two kinds)
Weight = Tensor | QuantWeight | PrepackedWeight  # what a matmul of the model multiplies by


def frozen(*shape: int, dtype: torch.dtype, device: str | None = None) -> nn.Parameter:
    """A model's weight, not trained; device "meta" for one that loading replaces with a
    quantized one (no memory until then)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def linear(x: Tensor, w: Weight, out: Tensor | None = None) -> Tensor:
    """x @ w.T for a plain, prepacked or quantized weight; our GEMMs write it into `out` when it
    fits (native.output: a buffer the forward reuses), the others into a new tensor."""
    return F.linear(x, w) if isinstance(w, Tensor) else w.mm(x, out)


def embed(ids: Tensor, w: Tensor | QuantWeight, dtype: torch.dtype) -> Tensor:
    if isinstance(w, Tensor):
        return F.embedding(ids, w)
    return w.rows(ids.flatten(), dtype).view(*ids.shape, w.shape[1])


def weight_nbytes(w: Weight) -> int:
    return w.nbytes if not isinstance(w, Tensor) else w.numel() * w.element_size()


# ---------------------------------------------------------------------------- GGUF blocks


@dataclass
class Blocks:
    """w[n, j] = q[n, j] * scale[n, j // group] + zero[n, j // group] (zero None: 0)."""

    q: Tensor  # [N, K] codes: uint8 0..15 (4 bits) or int8 (6 and 8 bits)
    scale: Tensor  # float32 [N, K / group]
    zero: Tensor | None
    group: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k

    def dequantize(self) -> Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // self.group, self.group) * self.scale[..., None]
        if self.zero is not None:
            w += self.zero[..., None]
        return w.view(n, k)

    def map_rows(self, fn) -> Blocks:
        """The same function (a row permutation) applied to codes, scales and zeros."""
        zero = None if self.zero is None else fn(self.zero)
        return Blocks(fn(self.q), fn(self.scale), zero, self.group, self.bits)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        first = parts[0]
        zeros = [p.zero if p.zero is not None else torch.zeros_like(p.scale) for p in parts]
        return Blocks(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            None if all(p.zero is None for p in parts) else torch.cat(zeros),
            first.group,
            first.bits,
        )

    @staticmethod
    def compatible(parts: list[Blocks]) -> bool:
        return len({(p.bits, p.group, p.q.shape[1]) for p in parts}) == 1


def pack_int4(b: Blocks) -> Int4Weight:
    """Blocks of 4-bit codes -> Int4Weight, in our GEMM's panels where it runs, else aten's layout.

    torch's zero convention: w = (q - 8) * s + z."""
    n, k = b.q.shape
    zero = b.zero if b.zero is not None else torch.zeros_like(b.scale)
    sz = torch.stack([b.scale, zero + 8 * b.scale], dim=-1).to(ACT_DTYPE)  # [N, K/group, 2]
    if int4_form() == "panels":
        # codes: byte j of a panel's k pair holds element j (low) and j + 32 (high) of the pair
        # row, element e being column e % 32 // 2 + 16 (e // 32) at k parity e % 2
        q = b.q.to(torch.uint8).view(n // 32, 2, 16, k // 2, 2).permute(0, 3, 1, 2, 4)
        q = q.reshape(n // 32, k // 2, 2, 32)
        codes = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()
        panels = sz.view(n // 32, 32, -1, 2).permute(0, 2, 3, 1).contiguous()  # [P, G, 2, 32]
        return Int4Weight(codes, panels, b.group, (n, k), True)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(b.q.to(torch.int32).contiguous(), 1)
    return Int4Weight(packed, sz.transpose(0, 1).contiguous(), b.group, (n, k))


def gguf_weight(b: Blocks, target: str, dtype: torch.dtype) -> Tensor | QuantWeight:
    """What --quantization gguf holds for a GGUF matrix (target: our weight's name).

    4-bit blocks run as they are (int4; per-row int8 unless the row count is a multiple of 64).
    6- and 8-bit blocks (Q6_K, Q8_0) have no exact kernel: the vocabulary matrices (embedding,
    lm_head) become per-row int8, which cost nothing measurable on Q8_0; the others are
    dequantized to `dtype`, since per-row int8 of a whole Q8_0 model cost +0.45% perplexity
    (float32 model) and +0.72% (bfloat16), over the 0.5% Q8_0 is allowed (BENCHMARKS.md).
    """
    vocab = target in ("embed_tokens", "lm_head")
    if b.bits == 4 and b.group in INT4_GROUPS and b.q.shape[0] % _BLOCK_N == 0:
        return pack_int4(b)  # (Int4Weight unpacks whole 64-row blocks; a partial one differs)
    if not (vocab or b.bits == 4):
        return b.dequantize().to(dtype)
    return Int8Weight.quantize(b.dequantize())


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """[nb, bytes] -> [nb, bytes / chunk, 2, chunk]: low nibbles of a chunk of bytes, then high
    ones."""
    q = qs.reshape(qs.shape[0], -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(
        1, 1, 2, 1
    )
    return q & np.uint8(0x0F)


def _parse(
    blocks: np.ndarray, qtype: QT
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    """codes [nb, block], scales [nb, groups], zeros or None, group, bits (layouts as in
    gguf.quants)."""
    nb = blocks.shape[0]
    if qtype == QT.Q8_0:
        return blocks[:, 2:].copy().view(np.int8), _f16(blocks[:, :2])[:, None], None, 32, 8
    if qtype in (QT.Q4_0, QT.Q4_1):
        d = _f16(blocks[:, :2])[:, None]
        zero = -8 * d if qtype == QT.Q4_0 else _f16(blocks[:, 2:4])[:, None]
        qs = blocks[:, 2:] if qtype == QT.Q4_0 else blocks[:, 4:]
        return _nibbles(qs, 16).reshape(nb, 32), d, zero, 32, 4
    if qtype == QT.Q4_K:
        d, dmin = _f16(blocks[:, :2])[:, None], _f16(blocks[:, 2:4])[:, None]
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16:], 32).reshape(nb, 256)
        return q, d * sc.reshape(nb, 8), -dmin * m.reshape(nb, 8), 32, 4
    if qtype == QT.Q6_K:
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc, d = blocks[:, 192:208].copy().view(np.int8), _f16(blocks[:, 208:210])[:, None]
        low = _nibbles(ql, 64).reshape(nb, -1, 32)
        high = (
            qh.reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        q = (low | (high.reshape(nb, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
        return q.reshape(nb, 256), d * sc, None, 16, 6
    raise NotImplementedError(qtype.name)


KEPT_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K)


def blocks_from_gguf(raw: np.ndarray, qtype: QT, shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's raw bytes ([N, bytes per row] uint8) as Blocks of the row-major `shape`."""
    n, k = shape
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    q, scale, zero, group, bits = _parse(np.ascontiguousarray(raw).reshape(-1, block_bytes), qtype)
    as_t = torch.from_numpy
    return Blocks(
        as_t(np.ascontiguousarray(q)).reshape(n, k),
        as_t(scale.astype(np.float32)).reshape(n, -1),
        None if zero is None else as_t(zero.astype(np.float32)).reshape(n, -1),
        group,
        bits,
    )


def resident_bytes(
    qtype: QT,
    shape: tuple[int, int],
    quantization: str,
    dtype_bytes: int,
    vocab: bool = False,
    dense: bool = False,
) -> int:
    """Bytes one weight matrix (vocab: the embedding or lm_head) takes in memory under
    `quantization`, as gguf_weight decides (what `pagedkv plan` shows); dense: packed weights
    keep their bfloat16 copy too."""
    n, k = shape
    eight_bit = qtype in (QT.Q8_0, QT.Q6_K)
    copy = n * k * 2 if dense else 0
    if quantization == "int8" or (quantization == "gguf" and eight_bit and vocab):
        return n * k + 2 * n + copy
    if quantization == "gguf" and qtype in KEPT_TYPES and not eight_bit:
        return n * k // 2 + 2 * 2 * n * (k // 32) + copy
    return n * k * dtype_bytes

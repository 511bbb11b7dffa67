"""Quantized KV blocks: fp8 (e4m3) or int8, one float32 scale per (block, KV head).

One layer's K (or V) is a `QuantizedCache`:

    data:   [num_blocks, num_kv_heads, block_size, head_dim]  float8_e4m3fn or int8
    scales: [num_blocks, num_kv_heads]                          float32

An element stands for data * scale. Every write keeps each touched block's
scale large enough for its new values: a block written at offset 0 is fresh
(whatever it held belonged to an earlier owner) and starts from the new
values' range; a later write that exceeds the scale grows it and requantizes
the entries already there, so one block never mixes two scales.

fp8 scales are powers of two. Relative precision of a float format does not
depend on the scale, so this costs nothing, and growing a scale by 2^k
divides the stored values by 2^k exactly: requantization adds no error
(except to values that sink below fp8's normal range). int8 keeps the exact
amax / 127, where a power of two would waste up to a bit. fp8 scales stop at
2^7, so magnitudes past 448 * 2^7 = 57344 (no real K or V) saturate; that
keeps scale * 2^120 finite for the fast dequantization below.

K and V are stored rotated (attention/rotation.py): `write` takes them as the model made them and
rotates them first (the C++ write, csrc/kv_quant.cpp, in the same pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv import native
from pagedkv.attention import rotation

SCALE_DTYPE = torch.float32
_MIN_SCALE = 2.0**-64  # scale of an all-zero block (keeps divisions finite)
_BF16_FROM_E4M3 = (
    -0x7810
)  # int16 0x87F0: the sign bit and the 7 exponent/mantissa bits, shifted left 4
_E4M3_IN_BF16 = 2.0**120  # what those bits, read as bfloat16, are divided by


@dataclass(frozen=True, slots=True)
class QuantFormat:
    dtype: torch.dtype
    qmax: float  # largest stored magnitude
    pow2_scales: bool
    max_scale: float = math.inf

    def scale_for(self, amax: Tensor) -> Tensor:
        """The smallest scale (of this format's kind) that keeps `amax` representable."""
        scale = (amax / self.qmax).clamp_min(_MIN_SCALE)
        if self.pow2_scales:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        return scale.clamp_max_(self.max_scale)

    def dequantize(self, q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        """q * scale as `dtype` (scale float32, broadcast against q)."""
        if self.dtype != torch.float8_e4m3fn:
            return q.to(dtype).mul_(scale.to(dtype))
        # torch converts float8 element by element on CPU (~4 ns each); these integer ops are
        # vectorised (~0.3 ns) and exact for every e4m3 value: its sign, exponent and mantissa bits
        # moved to bfloat16's places read as value * 2^-120 (subnormals included). Times a power-of-
        # two
        # scale * 2^120 (at most 2^127) the product is exact in bfloat16.
        bits = (
            q.view(torch.int8).to(torch.int16).bitwise_left_shift_(4).bitwise_and_(_BF16_FROM_E4M3)
        )
        return bits.view(torch.bfloat16).mul_((scale * _E4M3_IN_BF16).to(torch.bfloat16)).to(dtype)

    def quantize(self, x: Tensor, scale: Tensor | float) -> Tensor:
        """x / scale in the stored dtype (x float32, scale broadcast against it)."""
        y = (x / scale).clamp_(-self.qmax, self.qmax)
        if self.dtype == torch.int8:
            y = y.round_()
        return y.to(self.dtype)


FP8 = QuantFormat(
    torch.float8_e4m3fn,
    float(torch.finfo(torch.float8_e4m3fn).max),
    pow2_scales=True,
    max_scale=2.0**7,
)
INT8 = QuantFormat(torch.int8, 127.0, pow2_scales=False)
FORMATS: dict[torch.dtype, QuantFormat] = {FP8.dtype: FP8, INT8.dtype: INT8}


@dataclass(slots=True)
class SlotWrite:
    """Where a step's new tokens go, by block (computed once per write_kv, shared by K and V)."""

    blocks: Tensor  # [T] block of each token
    offsets: Tensor  # [T] offset inside it
    touched: Tensor  # [U] distinct blocks written
    which: Tensor  # [T] index of each token's block in `touched`
    fresh: Tensor  # [U] bool: written at offset 0, so its old contents are not kept

    @classmethod
    def of(cls, slot_mapping: Tensor, block_size: int) -> SlotWrite:
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping - blocks * block_size
        touched, which = torch.unique(blocks, return_inverse=True)
        fresh = torch.zeros(touched.numel(), dtype=torch.bool, device=blocks.device)
        fresh[which[offsets == 0]] = True
        return cls(blocks, offsets, touched, which, fresh)


@dataclass(slots=True)
class QuantizedCache:
    """One layer's K or V blocks, quantized, with their scales (views into KVStorage)."""

    data: Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    scales: Tensor  # [num_blocks, num_kv_heads] float32
    fmt: QuantFormat

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def native_writer(self, x: Tensor) -> native.Library | None:
        """The C++ write (csrc/kv_quant.cpp) when it serves this cache and these rows (of a float
        type, each contiguous), else None."""
        if not (
            x.is_cpu
            and x.dtype in native.FLOAT_DTYPES
            and x.stride(-1) == 1
            and x.stride(-2) == x.shape[-1]
            and self.data.is_cpu
            and self.data.is_contiguous()
            and self.scales.is_contiguous()
        ):
            return None
        return native.library()

    def write(self, x: Tensor, slot_mapping: Tensor, where: SlotWrite | None = None) -> None:
        """Store new values x [T, Hkv, D] (as the model made them: rotated here) at their slots,
        growing scales (and requantizing) as needed.

        `where` (the torch path's grouping of the slots) may be shared by the K and V writes of a
        step; it is built here when needed and not given.
        """
        lib = self.native_writer(x)
        if lib is not None:
            slots = slot_mapping.to(torch.int64).contiguous()
            num_blocks, num_heads, block_size, head_dim = self.data.shape
            lib.call(
                "quant_write",
                dtype=native.DTYPES[self.fmt.dtype],
                x_dtype=native.DTYPES[x.dtype],
                x=x.data_ptr(),
                x_stride=x.stride(0),
                num_tokens=x.shape[0],
                num_heads=num_heads,
                head_dim=head_dim,
                slots=slots.data_ptr(),
                data=self.data.data_ptr(),
                scales=self.scales.data_ptr(),
                num_blocks=num_blocks,
                block_size=block_size,
            )
            return
        x = rotation.rotate(x)
        where = where or SlotWrite.of(slot_mapping, self.data.shape[2])
        num_heads = x.shape[1]
        amax = torch.zeros(where.touched.numel(), num_heads, dtype=SCALE_DTYPE, device=x.device)
        amax.scatter_reduce_(
            0, where.which[:, None].expand(-1, num_heads), x.abs().amax(-1), "amax"
        )
        old = self.scales[where.touched].masked_fill_(where.fresh[:, None], 0.0)
        scale = torch.maximum(old, self.fmt.scale_for(amax))
        grown = (scale > old) & (old > 0)
        if grown.any():
            u, h = grown.nonzero(as_tuple=True)
            b = where.touched[u]
            ratio = (old[u, h] / scale[u, h])[:, None, None]
            self.data[b, h] = self.fmt.quantize(
                self.fmt.dequantize(self.data[b, h], ratio, SCALE_DTYPE), 1.0
            )
        self.scales[where.touched] = scale
        self.data[where.blocks, :, where.offsets] = self.fmt.quantize(
            x, scale[where.which][:, :, None]
        )

    def dequantize(self, blocks: Tensor, dtype: torch.dtype) -> Tensor:
        """Blocks [n] as [n, Hkv, block_size, D] values in `dtype` (as stored: rotated)."""
        # index_select: advanced indexing is ~25x slower on CPU
        scales = self.scales.index_select(0, blocks)[:, :, None, None]
        return self.fmt.dequantize(self.data.index_select(0, blocks), scales, dtype)

    def dequantize_rows(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Flat (block * Hkv + head) rows [R] as [R, block_size, D] values in `dtype`."""
        picked = self.data.view(-1, *self.data.shape[2:]).index_select(0, rows)
        return self.fmt.dequantize(
            picked, self.scales.view(-1).index_select(0, rows)[:, None, None], dtype
        )

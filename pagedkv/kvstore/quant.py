"""Quantized KV blocks: fp8 (e4m3) or int8, one float32 scale per (token, KV head).

One layer's K (or V) is a `QuantizedCache`:

    data:   [num_blocks, num_kv_heads, block_size, head_dim]  float8_e4m3fn or int8
    scales: [num_blocks, num_kv_heads, block_size]             float32

An element stands for data * scale. Each (token, head) row is quantized on its own, with the
smallest scale that holds its largest value, and never touched again. So the codes of a token's K
and V depend on nothing but the token's own values: not on the prompt chunk it came in, the tokens
beside it in its block, whether it was recomputed after a preemption or drafted beside rejected
tokens. (A scale per block, grown as tokens arrived and requantizing the block, was 6% smaller but
made a block's codes depend on how its tokens were split into steps.) Quantization still magnifies
the last-bit differences a float K gets from matmuls of other row counts: see BENCHMARKS.md.

fp8 scales are powers of two: the relative precision of a float format does not depend on the
scale, so this costs nothing, and it keeps the dequantization below exact. They stop at 2^7, so
magnitudes past 448 * 2^7 = 57344 (no real K or V) saturate; that keeps scale * 2^120 finite. int8
keeps the exact amax / 127, where a power of two would waste up to a bit.

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


def slot_rows(slot_mapping: Tensor, num_heads: int, block_size: int) -> Tensor:
    """[T * num_heads] flat rows, token-major, of a cache [num_blocks, num_heads, block_size, D]
    seen as [num_blocks * num_heads * block_size, D]: where each new token's heads go. (index_copy_
    to them is ~200x faster on CPU than advanced-index assignment, which took ~12 ms a call.)"""
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    heads = torch.arange(num_heads, device=slot_mapping.device)
    return ((blocks[:, None] * num_heads + heads) * block_size + offsets[:, None]).reshape(-1)


@dataclass(slots=True)
class QuantizedCache:
    """One layer's K or V blocks, quantized, with their scales (views into KVStorage)."""

    data: Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    scales: Tensor  # [num_blocks, num_kv_heads, block_size] float32
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

    def write(self, x: Tensor, slot_mapping: Tensor, rows: Tensor | None = None) -> None:
        """Store new values x [T, Hkv, D] (as the model made them: rotated here) at their slots,
        each (token, head) row with its own scale.

        `rows`: slot_rows of the slots, when the caller has them (store.py makes them once for K
        and V); the C++ write finds the rows itself.
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
        num_heads, block_size = self.data.shape[1:3]
        rows = slot_rows(slot_mapping, num_heads, block_size) if rows is None else rows
        y = rotation.rotate(x).reshape(-1, x.shape[-1])
        scale = self.fmt.scale_for(y.abs().amax(-1, keepdim=True))
        # byte copies: float8 has no index_copy_ on CPU
        codes = self.fmt.quantize(y, scale).view(torch.uint8)
        self.data.view(torch.uint8).view(-1, y.shape[-1]).index_copy_(0, rows, codes)
        self.scales.view(-1).index_copy_(0, rows, scale.view(-1))

    def dequantize(self, blocks: Tensor, dtype: torch.dtype) -> Tensor:
        """Blocks [n] as [n, Hkv, block_size, D] values in `dtype` (as stored: rotated)."""
        # index_select: advanced indexing is ~25x slower on CPU
        scales = self.scales.index_select(0, blocks)[..., None]
        return self.fmt.dequantize(self.data.index_select(0, blocks), scales, dtype)

    def dequantize_rows(self, rows: Tensor, dtype: torch.dtype) -> Tensor:
        """Flat (block * Hkv + head) rows [R] as [R, block_size, D] values in `dtype`."""
        picked = self.data.view(-1, *self.data.shape[2:]).index_select(0, rows)
        scales = self.scales.view(-1, self.data.shape[2]).index_select(0, rows)[..., None]
        return self.fmt.dequantize(picked, scales, dtype)

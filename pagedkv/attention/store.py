"""Writing a step's new K/V into the paged cache: the one way in, for every kind of cache.

The model hands over its fused q | k | v projection and the rotary tables (rope_and_store), with
the projection's bias and q/k norms where it has them (Qwen2, Qwen3):
where the library serves a float cache, one C++ pass (csrc/layer_ops.cpp) rotates q and k and
stores k and v at their slots; otherwise q and k are rotated (in C++ or torch) and write_kv stores
k and v, quantizing them for an fp8 / int8 cache after the Hadamard rotation such a cache holds
(QuantizedCache.write: in C++, csrc/kv_quant.cpp, when the library serves; rotation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from pagedkv import native
from pagedkv.attention.paged import Cache
from pagedkv.kvstore.quant import QuantizedCache, slot_rows
from pagedkv.model import ops


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorm of q and k before RoPE (Qwen3's q_norm and k_norm): [D] weights."""

    q: Tensor
    k: Tensor
    eps: float

    def weights(self) -> tuple[Tensor, Tensor]:
        return self.q, self.k


def rope_and_store(
    qkv: Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: Tensor,
    cos: Tensor | None,
    sin: Tensor | None,
    kv_cache: tuple[Cache, Cache],
    slot_mapping: Tensor,
    bias: Tensor | None = None,
    qk_norm: QKNorm | None = None,
) -> Tensor:
    """Rotates q and k of a fused [T, (Hq + 2 Hkv) * D] projection in place for their positions
    (RoPE) and stores the new k and v at their slots; returns q as [T, Hq, D] (a view of qkv).

    cos / sin: float32 [max_positions, R], rotate_half's sign folded into sin: the first R dims
    of each head turn (R < D: partial rotary, Phi-4-mini's), the rest pass; None: no rotation
    (a NoPE layer of SmolLM3's). bias: the
    projection's [(Hq + 2 Hkv) * D] bias (Qwen2), added first; qk_norm: the RMSNorm each q and k
    head gets before its rotation (Qwen3).
    """
    k_cache, v_cache = kv_cache
    tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    rotary_dim = 0 if cos is None else cos.shape[1]
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    weights = [t for t in (bias, *(qk_norm.weights() if qk_norm else ())) if t is not None]
    lib, store = None, None
    if isinstance(k_cache, Tensor) and isinstance(v_cache, Tensor):
        if k_cache.is_contiguous() and v_cache.is_contiguous():
            lib = native.library_for(qkv, *weights, k_cache, v_cache)
            store = None if lib is None else (k_cache, v_cache, _int64(slot_mapping))
    lib = lib or native.library_for(qkv, *weights)
    if lib is not None:  # with a store: the rotation and the store in one pass
        positions = _int64(positions)
        lib.call(
            "rope_cache",
            dtype=native.DTYPES[qkv.dtype],
            qkv=qkv.data_ptr(),
            num_tokens=tokens,
            row_stride=qkv.stride(0),
            num_q_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            positions=positions.data_ptr(),
            cos=native.ptr(cos),
            sin=native.ptr(sin),
            max_positions=0 if cos is None else cos.shape[0],
            slots=None if store is None else store[2].data_ptr(),
            k_cache=None if store is None else store[0].data_ptr(),
            v_cache=None if store is None else store[1].data_ptr(),
            num_blocks=k_cache.shape[0],
            block_size=k_cache.shape[2],
            threads=torch.get_num_threads(),
            bias=native.ptr(bias),
            q_norm=None if qk_norm is None else qk_norm.q.data_ptr(),
            k_norm=None if qk_norm is None else qk_norm.k.data_ptr(),
            norm_eps=0.0 if qk_norm is None else qk_norm.eps,
            rotary_dim=rotary_dim,
        )
        if store is not None:
            return q
    heads = qkv.view(tokens, -1, head_dim)
    if lib is None:
        if bias is not None:
            qkv.add_(bias)
        if qk_norm is not None:
            for part, weight in (
                (heads[:, :num_heads], qk_norm.q),
                (heads[:, num_heads : num_heads + num_kv_heads], qk_norm.k),
            ):
                normed = ops.rms_norm(part.reshape(-1, head_dim), weight, qk_norm.eps)[0]
                part.copy_(normed.view_as(part))
        if cos is not None and sin is not None:
            qk = heads[:, : num_heads + num_kv_heads, :rotary_dim]
            c, s = (t[positions].unsqueeze(1).to(qkv.dtype) for t in (cos, sin))
            qk.copy_(torch.addcmul(qk * c, qk.roll(rotary_dim // 2, dims=-1), s))
    kv = num_heads + num_kv_heads
    write_kv(k_cache, v_cache, heads[:, num_heads:kv], heads[:, kv:], slot_mapping)
    return q


def _int64(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def write_kv(k_cache: Cache, v_cache: Cache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new K/V ([T, Hkv, D]) at their slots (rotated and quantized for a quantized cache)."""
    _, num_heads, block_size, head_dim = k_cache.shape
    if isinstance(k_cache, QuantizedCache):
        rows = None if k_cache.native_writer(k) else slot_rows(slot_mapping, num_heads, block_size)
        k_cache.write(k, slot_mapping, rows)
        cast(QuantizedCache, v_cache).write(v, slot_mapping, rows)
        return
    rows = slot_rows(slot_mapping, num_heads, block_size)
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_plain = cast(Tensor, v_cache)
    v_plain.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_plain.dtype))

"""The ops around a decoder layer's matmuls: one fused C++ call each (csrc/layer_ops.cpp) when
the native library is built and the tensors are CPU ones it knows, else the same arithmetic in
plain torch (the reference the C++ is tested against).

Fusing them takes a decode step of SmolLM2-135M from about 40 torch ops per layer to 8 calls,
and a 2048-token prompt chunk from several slow bf16 passes over memory to one.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv import native


def _lib(first: Tensor, *others: Tensor) -> ctypes.CDLL | None:
    """The library, when it serves these tensors: CPU, one dtype it knows, rows of unit stride."""
    if not first.is_cpu or first.dtype not in native.DTYPE_CODES or first.stride(-1) != 1:
        return None
    for t in others:
        if t.dtype != first.dtype or not t.is_cpu or t.stride(-1) != 1:
            return None
    return native.library()


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """RMSNorm of x, or of x + residual when a residual is given (vLLM's fused add).

    Returns (normed, the new residual); the residual tensor given is updated in place. With no
    residual, x itself is the new residual.
    """
    rows, n = x.shape
    lib = _lib(x, weight) if residual is None else _lib(x, weight, residual)
    if lib is None or (residual is not None and not residual.is_contiguous()):
        if residual is not None:
            x = residual.add_(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype), x
    out = torch.empty((rows, n), dtype=x.dtype)
    lib.pagedkv_rms_norm(
        native.DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.stride(0),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        eps,
        torch.get_num_threads(),
    )
    return out, (x if residual is None else residual)


def silu_mul(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up of a fused [rows, 2 * n] gate | up projection: [rows, n]."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    lib = _lib(gate_up)
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    out = torch.empty((rows, n), dtype=gate_up.dtype)
    lib.pagedkv_silu_mul(
        native.DTYPE_CODES[gate_up.dtype],
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        rows,
        n,
        torch.get_num_threads(),
    )
    return out


def rope_and_cache(
    qkv: Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor | None = None,
    v_cache: Tensor | None = None,
    slot_mapping: Tensor | None = None,
) -> bool:
    """Rotates q and k of a fused [T, (Hq + 2 Hkv) * D] projection in place for their positions,
    and, given caches of qkv's dtype, stores k and v at their slots.

    cos / sin: float32 [max_positions, D], rotate_half's sign folded into sin. Returns False
    (having done nothing) where the library does not serve: the caller then rotates in torch.
    """
    slots_ptr: int | None
    k_ptr: int | None
    v_ptr: int | None
    if k_cache is None:
        lib = _lib(qkv)
        if lib is None:
            return False
        slots_ptr = k_ptr = v_ptr = None
        num_blocks, block_size = 0, 1
    else:
        if v_cache is None or slot_mapping is None:
            raise TypeError("rope_and_cache: k_cache, v_cache and slot_mapping go together")
        lib = _lib(qkv, k_cache, v_cache)
        if lib is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        slots_ptr, k_ptr, v_ptr = slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        num_blocks, block_size = k_cache.shape[0], k_cache.shape[2]
    positions = positions if positions.dtype == torch.int64 else positions.long()
    err = native.error_buffer()
    rc = lib.pagedkv_rope_cache(
        native.DTYPE_CODES[qkv.dtype],
        qkv.data_ptr(),
        qkv.shape[0],
        qkv.stride(0),
        num_heads,
        num_kv_heads,
        cos.shape[1],
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        slots_ptr,
        k_ptr,
        v_ptr,
        num_blocks,
        block_size,
        torch.get_num_threads(),
        err,
        native.ERR_LEN,
    )
    if rc:
        raise ValueError(err.value.decode())
    return True

"""Paged attention through block tables with the C++ kernel (csrc/paged_attention.cpp, built by
pagedkv.native).

Decode attention decides this engine's speed on a CPU (see shared/bench/README.md): torch can only
gather the scattered blocks first, which costs 10-20x the memory bound. The kernel reads the blocks
in place instead. Without the library, a plain torch path gives the same results, only slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv import native


def available() -> bool:
    """True when the C++ kernel is compiled and loaded (building it now if needed)."""
    return native.available()


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence (q: [B, Hq, D]) at position seq_lens[b] - 1; returns [B, Hq, D]."""
    return _attend(q, k_cache, v_cache, None, seq_lens, block_tables, scale, out)


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Queries q[query_start_loc[b]:query_start_loc[b+1]] of sequence b are its last tokens and
    attend causally to its seq_lens[b] keys in the cache (chunked prefill, speculative decode)."""
    return _attend(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out)


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 or out.stride(1) != q.shape[2]:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with contiguous heads, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    lib = native.library()
    code = native.DTYPE_CODES.get(q.dtype)
    if lib is None or code is None:
        return _torch_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out)
    seq_lens = _int32(seq_lens)
    block_tables = _int32(block_tables)
    qsl = None if query_start_loc is None else _int32(query_start_loc)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    err = native.error_buffer()
    rc = lib.pagedkv_paged_attention(
        code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        None if qsl is None else qsl.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        q.shape[0], seq_lens.shape[0], block_tables.shape[1], num_blocks, q.shape[1], num_kv_heads,
        block_size, head_dim, q.stride(0), out.stride(0), float(scale), torch.get_num_threads(),
        err, native.ERR_LEN,
    )
    if rc:
        raise ValueError(err.value.decode())
    return out


def _check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Checks what the kernel cannot see for itself; it checks every index it reads."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [T, Hq, D] and the caches [blocks, Hkv, block_size, D], got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and seq_lens.is_cpu and block_tables.is_cpu):
        raise ValueError("paged attention here runs on CPU tensors only")
    batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B] and block_tables [B, max_blocks], got "
                         f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}")
    if query_start_loc is not None and (query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1):
        raise ValueError(f"query_start_loc must be [B + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}")


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()


def _torch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """The same attention in plain torch: gather each sequence's blocks, then SDPA (GQA)."""
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    lens = seq_lens.tolist()
    starts = list(range(len(lens) + 1)) if query_start_loc is None else query_start_loc.tolist()
    for b, ctx in enumerate(lens):
        first, last = starts[b], starts[b + 1]
        if first == last:
            continue
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        k = k_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :ctx]
        v = v_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :ctx]
        qlen = last - first
        mask = None
        if qlen > 1:
            query_pos = torch.arange(ctx - qlen, ctx).unsqueeze(1)
            mask = torch.arange(ctx).unsqueeze(0) <= query_pos
        o = F.scaled_dot_product_attention(q[first:last].transpose(0, 1), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[first:last] = o.transpose(0, 1)
    return out

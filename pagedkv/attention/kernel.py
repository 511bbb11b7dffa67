"""Paged attention through block tables with the C++ kernel (csrc/paged_attention.cpp, built by
pagedkv.native).

Decode attention decides this engine's speed on a CPU (see shared/bench/README.md): torch can only
gather the scattered blocks first, which costs 10-20x the memory bound. The kernel reads the blocks
in place instead. This module only calls the kernel; paged.py decides between it and the torch
path (the same results, slower), which serves where the library is not built.
"""

from __future__ import annotations

import torch

from pagedkv import native
from pagedkv.attention.cascade import CascadePlan


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    cascade: CascadePlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per sequence (q: [B, Hq, D]) at position seq_lens[b] - 1; returns [B, Hq, D].

    A quantized cache (int8 or float8_e4m3fn) comes with float32 scales [num_blocks, Hkv,
    block_size]: element x of block b, head h, offset t stands for x * scales[b, h, t]. The kernel
    reads it in place. With a cascade plan (attention/cascade.py), each group's shared blocks are
    read once for all its members (same result; the torch path ignores the plan). A sliding
    `window` (0: none) limits each query at position p to the keys after p - window. `softcap`
    (0: none; Gemma 2's) turns each score s = scale q . k into softcap tanh(s / softcap).
    """
    return attend(
        q,
        k_cache,
        v_cache,
        None,
        seq_lens,
        block_tables,
        scale,
        out,
        k_scales,
        v_scales,
        cascade,
        window,
        softcap,
    )


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    cascade: CascadePlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Queries q[query_start_loc[b]:query_start_loc[b+1]] of sequence b are its last tokens and
    attend causally to its seq_lens[b] keys in the cache (chunked prefill, speculative decode).
    Quantized caches, cascade plans, windows and softcaps as in paged_attention_decode (a group's
    shared blocks end before each member's first query)."""
    return attend(
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        out,
        k_scales,
        v_scales,
        cascade,
        window,
        softcap,
    )


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    cascade: CascadePlan | None = None,
    window: int = 0,
    softcap: float = 0.0,
    lib: native.Library | None = None,
) -> torch.Tensor:
    """paged_attention_varlen, or with query_start_loc None paged_attention_decode. `lib`: a build
    of the kernels to run instead of this process's own (benchmarks/ab_attention.py times two
    builds against each other)."""
    lib = lib or native.library()
    if lib is None:
        raise RuntimeError("the C++ kernels are not built here (paged.paged_attention falls back)")
    _check_shapes(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    _check_dtypes(q, k_cache, v_cache, k_scales, v_scales)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = _output(q, out)
    seq_lens, block_tables = _int32(seq_lens), _int32(block_tables)
    qsl = None if query_start_loc is None else _int32(query_start_loc)
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    pre, group_start, members = (None, None, None) if cascade is None else _plan(cascade, seq_lens)
    lib.call(
        "paged_attention",
        dtype=native.DTYPES[q.dtype],
        kv_dtype=native.DTYPES[k_cache.dtype],
        q=q.data_ptr(),
        k=k_cache.data_ptr(),
        v=v_cache.data_ptr(),
        out=out.data_ptr(),
        k_scales=native.ptr(k_scales),
        v_scales=native.ptr(v_scales),
        query_start_loc=native.ptr(qsl),
        seq_lens=seq_lens.data_ptr(),
        block_tables=block_tables.data_ptr(),
        num_tokens=q.shape[0],
        num_seqs=seq_lens.shape[0],
        max_blocks=block_tables.shape[1],
        num_blocks=num_blocks,
        num_q_heads=q.shape[1],
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        q_stride=q.stride(0),
        out_stride=out.stride(0),
        scale=float(scale),
        threads=torch.get_num_threads(),
        pre=native.ptr(pre),
        group_start=native.ptr(group_start),
        group_members=native.ptr(members),
        num_groups=0 if cascade is None else cascade.num_groups,
        window=window,
        softcap=float(softcap),
    )
    return out


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The buffer the kernel writes: `out` when given (checked), else a new one like q."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype)
    if (
        out.shape != q.shape
        or out.dtype != q.dtype
        or out.stride(2) != 1
        or out.stride(1) != q.shape[2]
    ):
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} with contiguous heads, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    return out


def _plan(
    cascade: CascadePlan, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's arrays as the kernel reads them (pre, group_start, members: int32)."""
    if cascade.pre.shape != seq_lens.shape:
        raise ValueError(
            f"the cascade plan covers {cascade.pre.shape} sequences, the batch {seq_lens.shape}"
        )
    return _int32(cascade.pre), _int32(cascade.group_start), _int32(cascade.members)


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
        raise ValueError(
            f"q must be [T, Hq, D] and the caches [blocks, Hkv, block_size, D], got "
            f"{tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k {tuple(k_cache.shape)},"
            f" v {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if not (
        q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and seq_lens.is_cpu and block_tables.is_cpu
    ):
        raise ValueError("paged attention here runs on CPU tensors only")
    batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"seq_lens must be [B] and block_tables [B, max_blocks], got "
            f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}"
        )
    if query_start_loc is not None and (
        query_start_loc.dim() != 1 or query_start_loc.shape[0] != batch + 1
    ):
        raise ValueError(
            f"query_start_loc must be [B + 1] = [{batch + 1}], got {tuple(query_start_loc.shape)}"
        )


def _check_dtypes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> None:
    """q of a float type the kernel computes in; the cache of q's type, or quantized with scales."""
    if q.dtype not in native.FLOAT_DTYPES:
        raise ValueError(f"q's dtype {q.dtype} is not one the kernel computes in")
    if k_scales is None and v_scales is None:
        if not (q.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError(
                f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                f"{v_cache.dtype} (or come quantized with scales)"
            )
        return
    if k_cache.dtype not in native.QUANT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"scales go with an int8 or float8_e4m3fn cache,"
            f" got {k_cache.dtype} and {v_cache.dtype}"
        )
    want = tuple(k_cache.shape[:3])
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if (
            t is None
            or tuple(t.shape) != want
            or t.dtype != torch.float32
            or not t.is_contiguous()
            or not t.is_cpu
        ):
            raise ValueError(
                f"{name} must be a contiguous float32 CPU tensor {want}, got "
                f"{None if t is None else (tuple(t.shape), t.dtype)}"
            )


def _int32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()

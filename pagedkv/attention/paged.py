"""Attention over a paged KV cache: the C++ kernel (kernel.py) when it is built, else plain torch.

Cache layout, per layer (one block of one KV head is contiguous, which is
what the C++ kernel reads in place):

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

    flat slot s  ->  block s // block_size, offset s % block_size

A forward step is one flat, varlen batch: the new tokens of all sequences
concatenated. Sequence b owns query rows qsl[b]:qsl[b+1]; its context after
this step is seq_lens[b] tokens, so its query token i sits at position
seq_len - query_len + i and sees every position up to its own. A prefill
whose first blocks came from the prefix cache is just a query shorter than
its context. The step writes all new K/V first (store.py), then attends.
A layer with a sliding window W (Mistral, Phi-3, Qwen's upper layers) lets
the query at position p see only positions p - W < k <= p (transformers'
convention); the blocks before the window stay allocated. Gemma 2 soft-caps
each score s (already scaled) to softcap tanh(s / softcap) before the masks.

A quantized cache (fp8 / int8, kv/quant.py) comes as `QuantizedCache`s in
place of the two tensors: writes quantize into the slots, and attention
reads them with their scales: the kernel in place, the torch path by
dequantizing the blocks it gathers into the query's dtype. Quantized caches
hold K/V rotated (rotation.py), so q is rotated on the way in and the output
back on the way out (by the kernel itself; here around the torch path).

`_use_kernel` is the one choice between the kernel and the torch path below,
the only torch implementation of paged attention (`contiguous_attention` at
the end is the tests' reference, without blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv import native
from pagedkv.attention import cascade, kernel, rotation
from pagedkv.kvstore.quant import QuantizedCache

Cache = Tensor | QuantizedCache


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and which blocks each sequence reads."""

    slot_mapping: Tensor  # [T] int64 flat slot of each new token
    query_start_loc: Tensor  # [B+1] int32 cumsum of query lengths
    seq_lens: Tensor  # [B] int32 context length after this step
    block_tables: Tensor  # [B, max_blocks] int32, padded with 0
    query_lens: list[int]  # python copies: loops need no tensor syncs
    seq_lens_list: list[int]
    block_size: int
    is_decode: bool  # every query_len == 1
    # The model's narrowest sliding window (0: none). A cascade plan is made only while every
    # sequence fits in it: the kernel takes windows and plans apart.
    window: int = 0
    # Derived index tensors, built once per step and shared by every layer.
    _cache: dict = field(default_factory=dict, repr=False)


def _kv_dtype(q: Tensor, cache: Cache) -> torch.dtype:
    """What attention computes in: the cache's dtype, or the query's for a quantized cache."""
    return q.dtype if isinstance(cache, QuantizedCache) else cache.dtype


def _gather(cache: Cache, blocks: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """One sequence's first `length` cached tokens as [Hkv, length, D] (dtype: see _kv_dtype)."""
    num_heads, block_size, head_dim = cache.shape[1:]
    picked = (
        cache.dequantize(blocks, dtype)
        if isinstance(cache, QuantizedCache)
        else cache.index_select(0, blocks)
    )
    kv = picked.transpose(0, 1)
    return kv.reshape(num_heads, blocks.numel() * block_size, head_dim)[:, :length]


class _Workspace:
    """Reused gather buffers.

    A fresh multi-MiB tensor per layer costs more in page faults than the
    gather itself (allocations over 32 MiB are always new mmaps), so decode
    gathers K/V into buffers that live as long as the process and only grow.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        # a buffer made in inference mode cannot be written outside it (and the engine runs in it)
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        numel = 1
        for n in shape:
            numel *= n
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


_workspace = _Workspace()
_SCORE_BYTES = 16 << 20  # scores of one prefill chunk, counted at 4 bytes each


def _in_effect(meta: AttentionMetadata, window: int | None) -> int:
    """A layer's sliding window where it cuts some sequence of the step, else 0."""
    return window if window and max(meta.seq_lens_list, default=0) > window else 0


def _decode_indices(
    meta: AttentionMetadata,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int = 0,
) -> tuple[Tensor, Tensor, int]:
    """Flat (block, head) rows to gather for a decode batch, and the additive mask of the
    padding (and of the positions before a sliding window)."""
    key = ("decode", num_kv_heads, device, dtype, window)
    if key not in meta._cache:
        max_blocks = -(-max(meta.seq_lens_list) // meta.block_size)
        tables = meta.block_tables[:, :max_blocks].to(device=device, dtype=torch.int64)
        heads = torch.arange(num_kv_heads, device=device)
        rows = (tables[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
        length = max_blocks * meta.block_size
        pos = torch.arange(length, device=device)
        lens = meta.seq_lens.to(device)[:, None]
        pad = pos[None, :] >= lens  # [B, L]
        if window:
            pad |= pos[None, :] < lens - window
        bias = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(pad, float("-inf"))
        meta._cache[key] = (rows, bias[:, None, None, :], length)
    return meta._cache[key]


def _gather_rows(cache: Cache, rows: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    """Flat (block * Hkv + head) rows of the cache as [R, block_size, D], float ones in a reused
    buffer (dequantizing allocates its steps anyway)."""
    if isinstance(cache, QuantizedCache):
        return cache.dequantize_rows(rows, dtype)
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    out = _workspace.get(name, (rows.numel(), block_size, head_dim), dtype, rows.device)
    return torch.index_select(
        cache.view(num_blocks * num_kv_heads, block_size, head_dim), 0, rows, out=out
    )


def _decode(
    q: Tensor,
    k_cache: Cache,
    v_cache: Cache,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """All sequences at once: gather their blocks padded to the longest, mask the padding."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    dtype = _kv_dtype(q, k_cache)
    rows, bias, length = _decode_indices(meta, num_kv_heads, dtype, q.device, window)
    k = _gather_rows(k_cache, rows, "k", dtype)
    v = _gather_rows(v_cache, rows, "v", dtype)
    k = k.view(num_seqs, num_kv_heads, length, head_dim)
    v = v.view(num_seqs, num_kv_heads, length, head_dim)
    # The query heads of one KV head become its "query rows": no K/V expansion for GQA.
    group = num_q_heads // num_kv_heads
    qg = (q * scale).to(k.dtype).view(num_seqs, num_kv_heads, group, head_dim)
    out = _masked_attention(qg, k, v, bias, (num_seqs, num_kv_heads, group, length), softcap)
    return out.view(num_seqs, num_q_heads, head_dim).to(q.dtype)


def _masked_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, grouped: tuple[int, ...], softcap: float = 0.0
) -> Tensor:
    """softmax(q k^T + bias) v, with q already scaled (and q k^T soft-capped first when a
    softcap is given: softcap tanh(q k^T / softcap), Gemma 2's).

    Everything runs in the cache dtype: bf16 GEMMs are 2-3x faster than
    float32 ones on AVX-512 BF16 CPUs, and torch's bf16 softmax computes in
    float32 inside (same result as upcasting, half the time). The scores are
    viewed as `grouped` to add `bias` (0 or -inf). Measured on CPU: faster
    than scaled_dot_product_attention for both decode (a padding mask) and
    prefill (a causal mask).
    """
    scores = torch.matmul(q, k.transpose(-1, -2))
    if softcap:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores.view(grouped).add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _prefill_one(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: int = 0, softcap: float = 0.0
) -> Tensor:
    """q [Lq, Hq, D] against one sequence's whole context k, v [Hkv, L, D]; causal, bottom-aligned
    (and within a sliding window when one is given; scores soft-capped by softcap).

    Queries go in chunks that keep the scores under _SCORE_BYTES, and each
    chunk reads only the keys its last query can see.
    """
    qlen, num_q_heads, head_dim = q.shape
    num_kv_heads, klen, _ = k.shape
    group = num_q_heads // num_kv_heads
    offset = klen - qlen
    # [Hkv, G, Lq, D]: each KV head's query heads and tokens become its rows (no K/V expansion for
    # GQA)
    qg = (q * scale).to(k.dtype).view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    out = torch.empty(qlen, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    chunk = max(1, _SCORE_BYTES // (4 * num_q_heads * klen))
    keys = torch.arange(klen, device=q.device)
    for a in range(0, qlen, chunk):
        b = min(qlen, a + chunk)
        seen = offset + b
        qpos = torch.arange(offset + a, seen, device=q.device)
        future = keys[None, :seen] > qpos[:, None]
        if window:
            future |= keys[None, :seen] <= qpos[:, None] - window
        bias = torch.zeros(b - a, seen, dtype=k.dtype, device=q.device).masked_fill_(
            future, float("-inf")
        )
        rows = qg[:, :, a:b].reshape(num_kv_heads, group * (b - a), head_dim)
        o = _masked_attention(
            rows, k[:, :seen], v[:, :seen], bias, (num_kv_heads, group, b - a, seen), softcap
        )
        out[a:b] = (
            o.view(num_kv_heads, group, b - a, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(b - a, num_q_heads, head_dim)
        )
    return out


def _decode_part(meta: AttentionMetadata) -> tuple[AttentionMetadata, Tensor, frozenset[int]]:
    """The one-token queries of a mixed step as a decode batch of their own: its metadata,
    their rows in q, and their sequence indices (built once per step)."""
    if "decode_part" not in meta._cache:
        seqs = [b for b, n in enumerate(meta.query_lens) if n == 1]
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        device = meta.seq_lens.device
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        rows = torch.tensor([starts[b] for b in seqs], dtype=torch.int64, device=device)
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows],
            query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=device),
            seq_lens=meta.seq_lens[index],
            block_tables=meta.block_tables[index],
            query_lens=[1] * len(seqs),
            seq_lens_list=[meta.seq_lens_list[b] for b in seqs],
            block_size=meta.block_size,
            is_decode=True,
        )
        meta._cache["decode_part"] = (sub, rows, frozenset(seqs))
    return meta._cache["decode_part"]


def _use_kernel(q: Tensor, k_cache: Cache) -> bool:
    """The one choice between the C++ kernel (kernel.py) and the torch path: the kernel serves CPU
    attention when it is built, for q of a float type it computes in and a float cache of q's
    dtype or a quantized cache (read in place with its scales)."""
    return (
        q.device.type == "cpu"
        and q.dtype in native.FLOAT_DTYPES
        and (isinstance(k_cache, QuantizedCache) or q.dtype == k_cache.dtype)
        and native.available()
    )


def _kernel_attend(
    q: Tensor,
    k_cache: Cache,
    v_cache: Cache,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """The whole step in one kernel call, reading blocks in place (quantized ones with their
    scales): 4x faster than gathering them for decode, and 1.5-4x faster than the GEMM path for
    prompts (bf16, 128-2048 tokens)."""
    k_scales = v_scales = None
    if isinstance(k_cache, QuantizedCache):  # K and V caches are always of one kind
        v_quant = cast(QuantizedCache, v_cache)
        k_scales, v_scales = k_cache.scales, v_quant.scales
        k, v = k_cache.data, v_quant.data
    else:
        k, v = k_cache, cast(Tensor, v_cache)
    out = native.output(out, tuple(q.shape), q.dtype)
    plan = cascade_plan(meta)
    window = window if plan is None else 0  # (a plan: every sequence fits the narrowest window)
    return kernel.attend(
        q,
        k,
        v,
        None if meta.is_decode else meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        out,
        k_scales,
        v_scales,
        cascade=plan,
        window=window,
        softcap=softcap,
    )


def cascade_plan(meta: AttentionMetadata) -> cascade.CascadePlan | None:
    """The step's shared-prefix groups (attention/cascade.py), found once per step."""
    if "cascade" not in meta._cache:
        which = cascade.mode()
        meta._cache["cascade"] = (
            None
            if which == "0" or _in_effect(meta, meta.window)
            else cascade.plan(
                meta.block_tables,
                meta.seq_lens_list,
                meta.block_size,
                forced=which == "1",
                query_lens=None if meta.is_decode else meta.query_lens,
            )
        )
    return meta._cache["cascade"]


def paged_attention(
    q: Tensor,
    k_cache: Cache,
    v_cache: Cache,
    meta: AttentionMetadata,
    scale: float,
    out: Tensor | None = None,
    window: int | None = None,
    softcap: float = 0.0,
) -> Tensor:
    """Attention of the step's new tokens over their sequences' cached context: [T, Hq, D].

    Through the C++ kernel when it serves (see _use_kernel), else torch_attention. The kernel
    writes a float cache's result into `out` when it fits (native.output: the forward's reused
    buffer). `window`: the layer's sliding window, if it has one; `softcap`: its scores'
    soft-capping (0: none), softcap tanh(s / softcap) for each s = scale q . k.
    """
    if _use_kernel(q, k_cache):  # (which rotates for a quantized cache itself: rotation.py)
        return _kernel_attend(q, k_cache, v_cache, meta, scale, out, window or 0, softcap)
    if not isinstance(k_cache, QuantizedCache):
        return torch_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    # K/V are stored rotated (rotation.py): rotate q alike, and the output back.
    q_rotated = rotation.rotate(q).to(q.dtype)
    rotated = torch_attention(q_rotated, k_cache, v_cache, meta, scale, window, softcap)
    return rotation.unrotate(rotated).to(q.dtype)


def torch_attention(
    q: Tensor,
    k_cache: Cache,
    v_cache: Cache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float = 0.0,
) -> Tensor:
    """The torch path of paged attention (in the rotated space of a quantized cache): one-token
    queries (decodes) together in one batched pass, longer ones (prompts, prompt chunks after
    cached blocks) one sequence at a time."""
    window = _in_effect(meta, window)
    if meta.is_decode:
        return _decode(q, k_cache, v_cache, meta, scale, window, softcap)
    out = torch.empty_like(q)
    sub, rows, decodes = _decode_part(meta)
    if decodes:
        out[rows] = _decode(q[rows], k_cache, v_cache, sub, scale, window, softcap)
    start = 0
    for b, (qlen, slen) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
        if b not in decodes:
            blocks = meta.block_tables[b, : -(-slen // meta.block_size)].to(
                device=q.device, dtype=torch.int64
            )
            dtype = _kv_dtype(q, k_cache)
            k = _gather(k_cache, blocks, slen, dtype)
            v = _gather(v_cache, blocks, slen, dtype)
            out[start : start + qlen] = _prefill_one(
                q[start : start + qlen], k, v, scale, window, softcap
            )
        start += qlen
    return out


def contiguous_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal_offset: int,
    window: int = 0,
    softcap: float = 0.0,
) -> Tensor:
    """Plain causal attention (the reference): q [Lq, Hq, D], k/v [L, Hkv, D] with L = Lq + offset.

    Query i sits at position causal_offset + i and sees keys 0..causal_offset + i (only the last
    `window` of them when a window is given); `softcap` soft-caps the scores as Gemma 2 does.
    """
    qlen, num_q_heads, head_dim = q.shape
    klen, num_kv_heads, _ = k.shape
    qh = q.transpose(0, 1).to(k.dtype)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)
    gqa = num_q_heads != num_kv_heads
    if causal_offset == 0 and not window and not softcap:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out.transpose(0, 1).to(q.dtype)
    qpos = torch.arange(causal_offset, causal_offset + qlen, device=q.device)
    keys = torch.arange(klen, device=q.device)[None, :]
    mask = keys <= qpos[:, None]
    if window:
        mask &= keys > qpos[:, None] - window
    if softcap:  # (which scaled_dot_product_attention has no place for)
        group = num_q_heads // num_kv_heads
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        scores = torch.tanh(qh @ kh.transpose(-1, -2) * (scale / softcap)) * softcap
        out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vh
    else:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    return out.transpose(0, 1).to(q.dtype)

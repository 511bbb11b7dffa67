"""Cascade attention for steps whose sequences share leading KV blocks.

Sequences forked from one prompt (or hitting the same cached prefix) hold the same physical
block ids at the start of their block tables. Plain attention rereads those blocks once per
sequence; the cascade (csrc/paged_attention.cpp, the paged attention kernel given this plan)
reads a group's shared blocks once for all of its members' queries (a decode's one, a speculative
step's token and drafts, a short prompt chunk after a cached prefix); each suffix is then attended
apart, starting from its queries' running max, sum and weighted values over the prefix (a
log-sum-exp merge done by the online softmax itself). The plan here is found per step from the
block tables alone (the block manager already shares the ids), once per step and shared by all
layers.

PAGEDKV_CASCADE=0 never uses it, 1 uses it for every group found, auto (the default) only where
the kernel measured faster (see `pays`; figures in BENCHMARKS.md).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

MODES = ("0", "1", "auto")
# From benchmarks/bench_cascade.py --sweep (BENCHMARKS.md): the smallest group and prefix (in
# blocks) for which the cascade beat the plain kernel by 10% or more.
MIN_GROUP = 4
MIN_BLOCKS = 8
# The most queries of a sequence that joins a group in auto mode: a token and the default's four
# drafts (`bench_cascade.py --queries`, W2's shape: the cascade 1.35x / 1.24x the plain kernel at
# one query (AVX2 float32 / AVX-512 bfloat16), 1.10x / 1.02x at five, 1.14x / 0.97x at eight,
# 0.86x / 0.95x at 16: long prompt chunks attend better as their own items).
MAX_QUERIES = 5


@dataclass(frozen=True, slots=True)
class CascadePlan:
    """Which sequences of a decode batch share how many leading blocks (kernel arguments)."""

    pre: Tensor  # [B] int32 shared leading blocks of each sequence (0: not in a group)
    group_start: Tensor  # [num_groups + 1] int32 offsets into members
    members: Tensor  # [sum of group sizes] int32 sequence indices, group by group

    @property
    def num_groups(self) -> int:
        return self.group_start.numel() - 1


def mode() -> str:
    """$PAGEDKV_CASCADE (0, 1 or auto; default auto), checked."""
    value = os.environ.get("PAGEDKV_CASCADE", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"PAGEDKV_CASCADE={value!r} is not one of {', '.join(MODES)}")
    return value


def pays(members: int, blocks: int) -> bool:
    """Whether one group of `members` sharing `blocks` blocks is worth a cascade (auto mode)."""
    return members >= MIN_GROUP and blocks >= MIN_BLOCKS


def find_groups(
    block_tables: Tensor,
    seq_lens: list[int],
    block_size: int,
    min_members: int = 2,
    min_blocks: int = 1,
    query_lens: list[int] | None = None,
    max_queries: int | None = None,
) -> list[tuple[int, list[int]]]:
    """Groups of >= min_members sequences whose tables start with the same block ids, as
    (shared blocks, members): the longest run of identical leading ids in the group, kept to
    whole blocks before every member's first query (query_lens: each sequence's queries, its last
    tokens; None: one each), >= min_blocks. Sequences of more than max_queries queries stay out.
    A handful of tensor ops for the whole batch, whatever the number of groups."""
    qlens = query_lens or [1] * len(seq_lens)
    before = [n - q for n, q in zip(seq_lens, qlens)]  # keys before the first query
    by_first: dict[int, list[int]] = {}
    for b, (first, n) in enumerate(zip(block_tables[:, 0].tolist(), before)):
        if n >= block_size and (max_queries is None or qlens[b] <= max_queries):
            by_first.setdefault(first, []).append(b)
    groups = [m for m in by_first.values() if len(m) >= min_members]
    if not groups:
        return []
    seqs = [b for m in groups for b in m]
    leaders = [m[0] for m in groups for _ in m]
    # each member's run of leading ids equal to its group leader's, and its whole blocks before its
    # first query
    rows = block_tables[seqs]
    runs = (rows == block_tables[leaders]).int().cumprod(1).sum(1).tolist()
    found, i = [], 0
    for members in groups:
        shared = min(min(runs[i + j], before[b] // block_size) for j, b in enumerate(members))
        i += len(members)
        if shared >= min_blocks:
            found.append((shared, members))
    return found


def plan(
    block_tables: Tensor,
    seq_lens: list[int],
    block_size: int,
    forced: bool,
    query_lens: list[int] | None = None,
) -> CascadePlan | None:
    """The step's plan: every group found when `forced`, else those that pay; None when none."""
    if forced:
        groups = find_groups(block_tables, seq_lens, block_size, query_lens=query_lens)
    else:
        found = find_groups(
            block_tables, seq_lens, block_size, MIN_GROUP, MIN_BLOCKS, query_lens, MAX_QUERIES
        )
        groups = [g for g in found if pays(len(g[1]), g[0])]
    if not groups:
        return None
    pre = [0] * len(seq_lens)
    starts, members = [0], []
    for shared, group in groups:
        for b in group:
            pre[b] = shared
        members.extend(group)
        starts.append(len(members))
    return CascadePlan(*(torch.tensor(xs, dtype=torch.int32) for xs in (pre, starts, members)))


def reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    seq_lens: list[int],
    block_tables: Tensor,
    scale: float,
    cascade: CascadePlan,
    query_lens: list[int] | None = None,
) -> Tensor:
    """The cascade in float64 torch (for tests): each group's queries against its shared blocks
    in one product, each sequence's suffix alone (causally), merged by log-sum-exp. q [T, Hq, D]:
    sequence b's query_lens[b] last tokens (None: one each), sequence by sequence; a float cache
    [num_blocks, Hkv, block_size, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    qlens = query_lens or [1] * len(seq_lens)
    starts = [0, *itertools.accumulate(qlens)]
    qd = q.double().view(num_tokens, num_kv_heads, group, head_dim) * scale

    def keys(cache: Tensor, blocks: Tensor) -> Tensor:  # [Hkv, L, D]
        return cache[blocks.long()].double().transpose(0, 1).reshape(num_kv_heads, -1, head_dim)

    def partial(
        qs: Tensor, k: Tensor, v: Tensor, seen: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        s = torch.einsum("nhgd,hld->nhgl", qs, k)  # qs [n, Hkv, G, D]
        if seen is not None:  # [n, L]: which keys each query sees
            s = s.masked_fill(~seen[:, None, None, :], -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        return torch.einsum("nhgl,hld->nhgd", torch.exp(s - lse[..., None]), v), lse

    pre = cascade.pre.tolist()
    group_starts, members = cascade.group_start.tolist(), cascade.members.tolist()
    shared: dict[int, tuple[Tensor, Tensor]] = {}  # by query token
    for g in range(cascade.num_groups):
        idx = members[group_starts[g] : group_starts[g + 1]]
        tokens = [t for b in idx for t in range(starts[b], starts[b + 1])]
        blocks = block_tables[idx[0], : pre[idx[0]]]
        out, lse = partial(qd[tokens], keys(k_cache, blocks), keys(v_cache, blocks))
        shared.update({t: (out[i], lse[i]) for i, t in enumerate(tokens)})
    result = torch.empty(num_tokens, num_kv_heads, group, head_dim, dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        blocks = block_tables[b, pre[b] : math.ceil(n / block_size)]
        first = pre[b] * block_size
        k, v = keys(k_cache, blocks)[:, : n - first], keys(v_cache, blocks)[:, : n - first]
        positions = torch.arange(n - qlens[b], n) - first  # of the queries, from the suffix's start
        seen = torch.arange(n - first)[None, :] <= positions[:, None]
        out, lse = partial(qd[starts[b] : starts[b + 1]], k, v, seen)
        for i, t in enumerate(range(starts[b], starts[b + 1])):
            if t in shared:
                o2, l2 = shared[t]
                total = torch.logaddexp(lse[i], l2)
                result[t] = (
                    out[i] * torch.exp(lse[i] - total)[..., None]
                    + o2 * torch.exp(l2 - total)[..., None]
                )
            else:
                result[t] = out[i]
    return result.view(num_tokens, num_q_heads, head_dim).to(q.dtype)

"""The C++ paged attention kernel against plain softmax attention over gathered K/V, and the torch
path that paged.paged_attention takes without it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import native
from pagedkv.attention import kernel, paged
from pagedkv.attention.rotation import unrotate

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    window: int = 0  # sliding window (0: none)
    softcap: float = 0.0  # scores soft-capped to softcap tanh(s / softcap) (0: none)


def make_case(
    gen: torch.Generator,
    *,
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Case:
    """Blocks for every sequence drawn at random from a pool with spare blocks; the block tables
    are padded with block 0 past each sequence's last block."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = pool[used : used + n]
        used += n
    shape = (num_blocks, kv_heads, block_size, head_dim)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return Case(
        q=torch.randn(starts[-1], kv_heads * group, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(shape, generator=gen).to(dtype),
        v_cache=torch.randn(shape, generator=gen).to(dtype),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        scale=head_dim**-0.5,
    )


def metadata(c: Case) -> paged.AttentionMetadata:
    """The case as an engine step's attention metadata (its slots unused: nothing is stored)."""
    query_lens = c.query_start_loc.diff().tolist()
    return paged.AttentionMetadata(
        slot_mapping=torch.zeros(c.q.shape[0], dtype=torch.int64),
        query_start_loc=c.query_start_loc,
        seq_lens=c.seq_lens,
        block_tables=c.block_tables,
        query_lens=query_lens,
        seq_lens_list=c.seq_lens.tolist(),
        block_size=c.k_cache.shape[2],
        is_decode=all(n == 1 for n in query_lens),
    )


def reference(c: Case) -> torch.Tensor:
    """Float64 softmax attention: gather each sequence's K/V through its block table, query i of a
    sequence with n queries and L keys sees keys 0 .. L - n + i (the last c.window of them), its
    scores soft-capped when c.softcap is set."""
    num_kv_heads, block_size = c.k_cache.shape[1], c.k_cache.shape[2]
    group = c.q.shape[1] // num_kv_heads
    out = torch.zeros(c.q.shape, dtype=torch.float64)
    for b, length in enumerate(c.seq_lens.tolist()):
        first, last = c.query_start_loc[b].item(), c.query_start_loc[b + 1].item()
        if first == last:
            continue
        positions = torch.arange(length)
        blocks = c.block_tables[b, positions // block_size].long()
        offsets = positions % block_size
        k = c.k_cache[blocks, :, offsets].double()  # [L, Hkv, D]
        v = c.v_cache[blocks, :, offsets].double()
        for i in range(last - first):
            visible = length - (last - first) + i + 1
            start = max(0, visible - c.window) if c.window else 0
            for head in range(c.q.shape[1]):
                kv = head // group
                scores = k[start:visible, kv] @ c.q[first + i, head].double() * c.scale
                if c.softcap:
                    scores = torch.tanh(scores / c.softcap) * c.softcap
                out[first + i, head] = torch.softmax(scores, 0) @ v[start:visible, kv]
    return out


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_matches(got: torch.Tensor, c: Case) -> None:
    assert got.dtype == c.q.dtype and got.shape == c.q.shape
    tol = TOLERANCE[c.q.dtype]
    torch.testing.assert_close(got.double(), reference(c), atol=tol, rtol=tol)


def run_case(c: Case, threads: int | None = None, decode: bool = False) -> torch.Tensor:
    """The kernel on the case (with its window and softcap), on `threads` torch threads when
    given."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    rules = {"window": c.window, "softcap": c.softcap}
    try:
        if decode:
            return kernel.paged_attention_decode(
                c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale, **rules
            )
        qsl = c.query_start_loc
        return kernel.paged_attention_varlen(
            c.q, c.k_cache, c.v_cache, qsl, c.seq_lens, c.block_tables, c.scale, **rules
        )
    finally:
        torch.set_num_threads(before)


def test_kernel_is_built_here() -> None:
    assert kernel.available(), "the compiler is installed here, so the kernel must build"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 128), (3, 80)])
def test_decode_matches_reference(
    dtype: torch.dtype, block_size: int, group: int, head_dim: int, kernel_isa
) -> None:
    gen = torch.Generator().manual_seed(block_size * 1000 + group * 10 + head_dim)
    # Lengths 1 .. 1000, including exactly full blocks and one-past-full ones.
    lens = [1, 2, 17, block_size, block_size + 1, 1000] + torch.randint(
        1, 1001, (4,), generator=gen
    ).tolist()
    c = make_case(
        gen,
        seq_lens=lens,
        query_lens=[1] * len(lens),
        block_size=block_size,
        kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    got = kernel.paged_attention_decode(
        c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale
    )
    assert_matches(got, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 64), (4, 128), (3, 80)])
def test_varlen_matches_reference(
    dtype: torch.dtype, block_size: int, group: int, head_dim: int, kernel_isa
) -> None:
    gen = torch.Generator().manual_seed(7 + block_size + group + head_dim)
    lens = [5, 40, 300, 999, 64]
    # A whole prompt as one chunk, chunks of a longer prompt, a decode, a speculative burst, and
    # a sequence with no queries in this step.
    queries = [5, 33, 12, 1, 0]
    c = make_case(
        gen,
        seq_lens=lens,
        query_lens=queries,
        block_size=block_size,
        kv_heads=3,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    got = kernel.paged_attention_varlen(
        c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_tables, c.scale
    )
    assert_matches(got, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [3, 8])
def test_many_query_rows_across_tile_edges(dtype: torch.dtype, group: int, kernel_isa) -> None:
    """Prompt chunks of many query rows (the panel path) whose tokens straddle 64-key tiles, so
    that a tile is seen by only the later rows of a panel, and chunks starting at position 0."""
    c = make_case(
        torch.Generator().manual_seed(group),
        seq_lens=[65, 130, 200, 70, 64],
        query_lens=[17, 40, 70, 70, 63],
        block_size=16,
        kv_heads=2,
        group=group,
        head_dim=64,
        dtype=dtype,
    )
    got = kernel.paged_attention_varlen(
        c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_tables, c.scale
    )
    assert_matches(got, c)


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "most"),
    [([600, 300], [64, 48], 1.5), ([600, 300, 455, 800, 130, 1000, 64, 700], [1] * 8, 1.15)],
    ids=["prompt_chunks", "decode"],
)
def test_bf16_output_err_about_as_bf16_rounds(seq_lens, query_lens, most, kernel_isa) -> None:
    """bfloat16 outputs, whose softmaxes take a coarse exp (vexp2_bf16: decode's dot products on
    every ISA, prompt chunks on AMX tiles, which also round p to bf16), stay near the error of
    rounding the exact result to bf16: the RMS error is 1.35x that rounding's for AMX's prompt
    chunks, 1.0x elsewhere. assert_matches' 2e-2 would let a probability 1% off pass; an exp
    0.35% off makes this 1.75x for AMX's prompt chunks and 1.41x for decode."""
    c = make_case(
        torch.Generator().manual_seed(0),
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=16,
        kv_heads=2,
        group=3,
        head_dim=64,
        dtype=torch.bfloat16,
    )
    got = run_case(c, decode=query_lens[0] == 1).double()
    want = reference(c)
    rms = want.pow(2).mean().sqrt()
    rounding = (want.bfloat16().double() - want).pow(2).mean().sqrt() / rms
    err = (got - want).pow(2).mean().sqrt() / rms
    assert err < most * rounding, (err.item(), rounding.item())


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 16, 48, 256]),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 5),
    head_dim=st.sampled_from([16, 24, 64, 80, 128]),
    threads=st.integers(1, 3),
    window=st.one_of(st.just(0), st.integers(1, 400)),
    softcap=st.one_of(st.just(0.0), st.floats(0.5, 30.0)),
)
def test_random_batches(
    data,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    threads: int,
    window: int,
    softcap: float,
) -> None:
    lens = data.draw(st.lists(st.integers(1, 700), min_size=1, max_size=5))
    queries = [data.draw(st.integers(0, min(n, 90))) for n in lens]
    c = make_case(
        torch.Generator().manual_seed(len(lens)),
        seq_lens=lens,
        query_lens=queries,
        block_size=block_size,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
    )
    c.window, c.softcap = window, softcap  # (0: none)
    assert_matches(run_case(c, threads=threads), c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [1, 17, 64, 100, 300])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (4, 128), (2, 80)])
def test_sliding_window_matches_reference(
    dtype: torch.dtype, block_size: int, window: int, group: int, head_dim: int, kernel_isa
) -> None:
    """Each query sees only the last `window` keys up to its own: decodes (items starting inside
    a block), prompt chunks whose rows' windows start in different tiles (many rows: the panel
    path), a chunk longer than the window, sequences shorter than it, and split-K pieces of a long
    decode on two threads."""
    gen = torch.Generator().manual_seed(window * 7 + block_size + group)
    lens = [1, 50, 333, 1000, 250, 2500]
    queries = [1, 1, 70, 200, 3, 1]
    c = make_case(
        gen,
        seq_lens=lens,
        query_lens=queries,
        block_size=block_size,
        kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    c.window = window
    got = run_case(c, threads=2)
    assert_matches(got, c)
    decode = one_query_rows(c, [0, 1, 5])
    assert_matches(run_case(decode, threads=2, decode=True), decode)
    c.window = 0
    assert not torch.allclose(run_case(c)[-1].float(), got[-1].float())  # the window cut something


def one_query_rows(c: Case, seqs: list[int]) -> Case:
    """The case's one-query sequences `seqs` as a decode batch of their own."""
    rows = torch.tensor(seqs)
    return Case(
        c.q[c.query_start_loc[rows].long()],
        c.k_cache,
        c.v_cache,
        torch.arange(len(seqs) + 1, dtype=torch.int32),
        c.seq_lens[rows],
        c.block_tables[rows],
        c.scale,
        c.window,
        c.softcap,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize(("block_size", "window"), [(1, 0), (16, 0), (16, 40)])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (2, 256)])
def test_softcap_matches_reference(
    dtype: torch.dtype,
    softcap: float,
    block_size: int,
    window: int,
    group: int,
    head_dim: int,
    kernel_isa,
) -> None:
    """Gemma 2's soft-capped scores (softcap tanh(s / softcap)), with and without its window:
    decodes, prompt chunks of many rows (the panel path), and split-K pieces of a long decode on
    two threads; a cap of 0 leaves the scores as they are."""
    gen = torch.Generator().manual_seed(block_size + window + head_dim)
    c = make_case(
        gen,
        seq_lens=[1, 50, 333, 1000, 250, 2500],
        query_lens=[1, 1, 70, 200, 3, 1],
        block_size=block_size,
        kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
    )
    c.scale *= 4  # (scores of a few units, which a cap of 2 bends)
    c.window, c.softcap = window, softcap
    got = run_case(c, threads=2)
    assert_matches(got, c)
    decode = one_query_rows(c, [0, 1, 5])
    assert_matches(run_case(decode, threads=2, decode=True), decode)
    c.softcap = 2.0 - softcap
    assert not torch.allclose(run_case(c)[3:].float(), got[3:].float(), atol=0.05)


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_a_bad_softcap_is_refused(value: float) -> None:
    c = make_case(
        torch.Generator().manual_seed(0),
        seq_lens=[40],
        query_lens=[1],
        block_size=16,
        kv_heads=1,
        group=1,
        head_dim=16,
        dtype=torch.float32,
    )
    c.softcap = value
    with pytest.raises(ValueError, match="softcap .*: negative or not finite"):
        run_case(c, decode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 1.0])
def test_torch_path_takes_the_window(dtype: torch.dtype, softcap: float) -> None:
    """The torch path (decodes batched, prompts one by one) masks the same keys as the kernel (and
    soft-caps the scores as it does)."""
    c = make_case(
        torch.Generator().manual_seed(3),
        seq_lens=[20, 300, 130, 77],
        query_lens=[1, 1, 60, 1],
        block_size=16,
        kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
    )
    c.window, c.softcap = 50, softcap
    got = paged.torch_attention(c.q, c.k_cache, c.v_cache, metadata(c), c.scale, 50, softcap)
    assert_matches(got, c)
    d = one_query_rows(c, [0, 1, 3])
    got = paged.torch_attention(d.q, d.k_cache, d.v_cache, metadata(d), d.scale, 50, softcap)
    assert_matches(got, d)


def test_window_with_a_cascade_plan_is_refused() -> None:
    from pagedkv.attention.cascade import CascadePlan

    c = make_case(
        torch.Generator().manual_seed(0),
        seq_lens=[40, 40],
        query_lens=[1, 1],
        block_size=16,
        kv_heads=1,
        group=1,
        head_dim=16,
        dtype=torch.float32,
    )
    c.block_tables[1, :2] = c.block_tables[0, :2]
    pre, starts, members = (torch.tensor(x, dtype=torch.int32) for x in ([2, 2], [0, 2], [0, 1]))
    plan = CascadePlan(pre, starts, members)
    args = (c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale)
    kernel.paged_attention_decode(*args, cascade=plan)  # the plan is good
    with pytest.raises(ValueError, match="window 8: negative, or given with a cascade plan"):
        kernel.paged_attention_decode(*args, cascade=plan, window=8)
    with pytest.raises(ValueError, match="window -1"):
        kernel.paged_attention_decode(*args, window=-1)


@pytest.mark.parametrize("head_dim", [8, 40, 72, 96, 100, 256])
def test_unusual_head_dims(head_dim: int, kernel_isa) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    c = make_case(
        gen,
        seq_lens=[1, 50, 333],
        query_lens=[1, 3, 2],
        block_size=16,
        kv_heads=2,
        group=3,
        head_dim=head_dim,
        dtype=torch.float32,
    )
    got = kernel.paged_attention_varlen(
        c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_tables, c.scale
    )
    assert_matches(got, c)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_long_single_sequence_split_across_threads(threads: int, kernel_isa) -> None:
    """One long sequence is cut into key ranges merged afterwards; the thread count must not
    change the result."""
    gen = torch.Generator().manual_seed(threads)
    c = make_case(
        gen,
        seq_lens=[4000],
        query_lens=[1],
        block_size=16,
        kv_heads=1,
        group=4,
        head_dim=64,
        dtype=torch.float32,
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.paged_attention_decode(
            c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale
        )
        c2 = make_case(
            gen,
            seq_lens=[3000, 20],
            query_lens=[7, 2],
            block_size=32,
            kv_heads=2,
            group=3,
            head_dim=64,
            dtype=torch.float32,
        )
        got2 = kernel.paged_attention_varlen(
            c2.q, c2.k_cache, c2.v_cache, c2.query_start_loc, c2.seq_lens, c2.block_tables, c2.scale
        )
    finally:
        torch.set_num_threads(before)
    assert_matches(got, c)
    assert_matches(got2, c2)


def test_out_buffer_and_strided_queries() -> None:
    """q may be a view into a fused QKV projection (rows further apart than Hq * D), and the
    result can go into a slice of a preallocated buffer."""
    gen = torch.Generator().manual_seed(3)
    c = make_case(
        gen,
        seq_lens=[70, 9],
        query_lens=[1, 1],
        block_size=16,
        kv_heads=2,
        group=3,
        head_dim=64,
        dtype=torch.float32,
    )
    fused = torch.randn(2, 10, 64, generator=gen)
    fused[:, :6] = c.q
    q_view = fused[:, :6]
    assert not q_view.is_contiguous()
    buffer = torch.full((2, 10, 64), 7.0)
    out = buffer[:, 2:8]
    got = kernel.paged_attention_decode(
        q_view, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    assert_matches(got, c)
    assert torch.all(buffer[:, :2] == 7.0) and torch.all(buffer[:, 8:] == 7.0)


def test_empty_batches() -> None:
    """No sequences, or sequences without queries this step, leave nothing to do."""
    cache = torch.randn(4, 1, 16, 64)
    none = kernel.paged_attention_decode(
        torch.empty(0, 2, 64),
        cache,
        cache,
        torch.empty(0, dtype=torch.int32),
        torch.empty(0, 1, dtype=torch.int32),
        0.125,
    )
    assert none.shape == (0, 2, 64)
    idle = kernel.paged_attention_varlen(
        torch.empty(0, 2, 64),
        cache,
        cache,
        torch.zeros(3, dtype=torch.int32),
        torch.tensor([5, 9], dtype=torch.int32),
        torch.tensor([[0], [1]], dtype=torch.int32),
        0.125,
    )
    assert idle.shape == (0, 2, 64)


def test_metadata_in_int64_is_accepted() -> None:
    gen = torch.Generator().manual_seed(4)
    c = make_case(
        gen,
        seq_lens=[30],
        query_lens=[1],
        block_size=16,
        kv_heads=1,
        group=1,
        head_dim=64,
        dtype=torch.float32,
    )
    got = kernel.paged_attention_decode(
        c.q, c.k_cache, c.v_cache, c.seq_lens.long(), c.block_tables.long(), c.scale
    )
    assert_matches(got, c)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.block_tables.__setitem__((0, 0), 10_000), "outside the cache"),
        (lambda c: c.block_tables.__setitem__((0, 0), -1), "outside the cache"),
        (lambda c: c.seq_lens.__setitem__(0, 10_000), "longer"),
        (lambda c: c.query_start_loc.__setitem__(2, 40), "from 0 to"),
        (lambda c: c.seq_lens.__setitem__(1, 1), "fewer keys"),
    ],
)
def test_bad_metadata_is_refused_not_read(change, message: str) -> None:
    gen = torch.Generator().manual_seed(5)
    c = make_case(
        gen,
        seq_lens=[20, 30],
        query_lens=[1, 3],
        block_size=16,
        kv_heads=1,
        group=2,
        head_dim=64,
        dtype=torch.float32,
    )
    change(c)
    with pytest.raises(ValueError, match=message):
        kernel.paged_attention_varlen(
            c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_tables, c.scale
        )


def test_mismatched_shapes_are_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    c = make_case(
        gen,
        seq_lens=[20],
        query_lens=[1],
        block_size=16,
        kv_heads=2,
        group=1,
        head_dim=64,
        dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="multiple"):
        kernel.paged_attention_decode(
            c.q[:, :1].expand(1, 3, 64), c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale
        )
    with pytest.raises(ValueError, match="dtype"):
        kernel.paged_attention_decode(
            c.q.double(), c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale
        )
    with pytest.raises(ValueError, match="out must be"):
        kernel.paged_attention_decode(
            c.q,
            c.k_cache,
            c.v_cache,
            c.seq_lens,
            c.block_tables,
            c.scale,
            out=torch.empty(1, 2, 32),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_reference(dtype: torch.dtype) -> None:
    """The path used when the kernel cannot be built gives the same answers."""
    gen = torch.Generator().manual_seed(8)
    c = make_case(
        gen,
        seq_lens=[1, 100, 257],
        query_lens=[1, 4, 9],
        block_size=16,
        kv_heads=3,
        group=3,
        head_dim=64,
        dtype=dtype,
    )
    got = paged.torch_attention(c.q, c.k_cache, c.v_cache, metadata(c), c.scale)
    assert_matches(got, c)


def test_build_failure_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def broken() -> Path:
        raise RuntimeError("Error building extension: no compiler")

    monkeypatch.setattr(native, "_build", broken)
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_lib", None)
    gen = torch.Generator().manual_seed(9)
    c = make_case(
        gen,
        seq_lens=[40, 3],
        query_lens=[1, 1],
        block_size=16,
        kv_heads=1,
        group=3,
        head_dim=64,
        dtype=torch.float32,
    )
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not kernel.available()
        got = paged.paged_attention(c.q, c.k_cache, c.v_cache, metadata(c), c.scale)
        paged.paged_attention(c.q, c.k_cache, c.v_cache, metadata(c), c.scale)
        with pytest.raises(RuntimeError, match="not built"):  # the kernel alone never falls back
            kernel.paged_attention_decode(
                c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale
            )
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()
    assert_matches(got, c)


def test_gil_is_released_during_the_call() -> None:
    """Another Python thread keeps running while the kernel works."""
    gen = torch.Generator().manual_seed(10)
    c = make_case(
        gen,
        seq_lens=[1000] * 64,
        query_lens=[1] * 64,
        block_size=16,
        kv_heads=3,
        group=3,
        head_dim=64,
        dtype=torch.float32,
    )
    args = (c.q, c.k_cache, c.v_cache, c.seq_lens, c.block_tables, c.scale)
    kernel.paged_attention_decode(*args)
    start = time.perf_counter()
    kernel.paged_attention_decode(*args)
    one_call = time.perf_counter() - start
    repeats = max(1, int(0.3 / one_call))

    def work() -> None:
        for _ in range(repeats):
            kernel.paged_attention_decode(*args)

    worker = threading.Thread(target=work)
    ticks = 0
    worker.start()
    begun = time.perf_counter()
    while worker.is_alive():
        ticks += 1
    busy = time.perf_counter() - begun
    worker.join()
    # With the GIL held for each call, this loop could only run between calls: a few ticks each.
    assert ticks > 50 * repeats, (ticks, repeats, busy)


@pytest.mark.slow
def test_concurrent_first_builds_share_one_compile(tmp_path: Path) -> None:
    """Two processes that start at once with an empty cache both end up with a working kernel."""
    script = (
        "import torch; from pagedkv import native as n; from pagedkv.attention import kernel as k;"
        "key = n._build_key(); ok = k.available() and n._build_key() == key;"
        "q = torch.randn(1, 2, 64); c = torch.randn(2, 1, 16, 64);"
        "o = k.paged_attention_decode(q, c, c, torch.tensor([5], dtype=torch.int32),"
        " torch.tensor([[1]], dtype=torch.int32), 0.125);"
        "print(ok, n.build_seconds is not None, bool(torch.isfinite(o).all()))"
    )
    env = {**os.environ, "PAGEDKV_EXT_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    lines = [out.strip() for out, _ in results]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert sorted(lines) == ["True False True", "True True True"], lines
    built = list(tmp_path.glob("*/built"))
    assert len(built) == 1


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_quantized_cache_is_read_in_place_with_its_scales(
    cache_dtype, dtype, softcap, kernel_isa
) -> None:
    """int8 / fp8 blocks with a scale per (token, KV head) give the attention of the values they
    stand for, rotated back: a quantized cache holds K and V rotated (attention/rotation.py), and
    the kernel rotates q in and its output back. Soft-capped scores too (Gemma 2)."""
    gen = torch.Generator().manual_seed(11)
    c = make_case(
        gen,
        seq_lens=[1, 40, 300, 97],
        query_lens=[1, 1, 7, 97],
        block_size=16,
        kv_heads=2,
        group=3,
        head_dim=64,
        dtype=torch.float32,
    )
    num_blocks, heads, block_size = c.k_cache.shape[:3]
    scales = {}
    stored = {}
    for name in ("k", "v"):
        values = getattr(c, f"{name}_cache")
        scale = torch.rand(num_blocks, heads, block_size, generator=gen) * 0.05 + 0.001
        if cache_dtype == torch.int8:
            data = (values / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
        else:  # values / scale spans e4m3 from its subnormals to its saturation at 448
            data = (values / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert ((data.float().abs() > 0) & (data.float().abs() < 2.0**-6)).any() and (
                data.float().abs() == 448
            ).any()
        scales[f"{name}_scales"], stored[name] = scale, data
        setattr(
            c, f"{name}_cache", unrotate(data.float() * scale[..., None]).to(dtype)
        )  # what they stand for
    c.q = c.q.to(dtype)
    c.softcap = softcap
    got = kernel.paged_attention_varlen(
        c.q,
        stored["k"],
        stored["v"],
        c.query_start_loc,
        c.seq_lens,
        c.block_tables,
        c.scale,
        softcap=softcap,
        **scales,
    )
    assert_matches(got, c)
    decode = make_case(
        gen,
        seq_lens=[5, 333],
        query_lens=[1, 1],
        block_size=16,
        kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
    )
    tables = c.block_tables[[1, 2]]
    lens = torch.tensor([40, 300], dtype=torch.int32)
    want = kernel.paged_attention_decode(
        decode.q, c.k_cache, c.v_cache, lens, tables, c.scale, softcap=softcap
    )
    got = kernel.paged_attention_decode(
        decode.q, stored["k"], stored["v"], lens, tables, c.scale, softcap=softcap, **scales
    )
    torch.testing.assert_close(
        got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


def test_quantized_cache_needs_matching_scales() -> None:
    cache = torch.zeros(4, 2, 16, 64, dtype=torch.int8)
    q = torch.randn(1, 2, 64)
    args = (
        q,
        cache,
        cache,
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([[1]], dtype=torch.int32),
        0.125,
    )
    with pytest.raises(ValueError, match="must be a contiguous float32 CPU tensor"):
        kernel.paged_attention_decode(
            *args, k_scales=torch.ones(4, 2, 16), v_scales=torch.ones(4, 2)
        )
    with pytest.raises(ValueError, match="share a dtype"):
        kernel.paged_attention_decode(*args)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        kernel.paged_attention_decode(
            q,
            q.new_zeros(4, 2, 16, 64),
            q.new_zeros(4, 2, 16, 64),
            *args[3:],
            k_scales=torch.ones(4, 2, 16),
            v_scales=torch.ones(4, 2, 16),
        )

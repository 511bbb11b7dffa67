"""Cascade attention (attention/cascade.py, the kernel given a plan): groups of sequences sharing
leading blocks give the same result as the plain kernel and the torch reference, in decode steps,
speculative steps and prompt chunks."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.attention import cascade, kernel
from pagedkv.attention.rotation import unrotate

BS = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

needs_kernel = pytest.mark.skipif(not kernel.available(), reason="the C++ kernel did not build")


def make_tables(
    gen: torch.Generator, groups: list[tuple[int, int]], singles: int, diverge: bool = True
) -> tuple[torch.Tensor, list[int], int]:
    """Block tables for groups of (members, shared blocks) plus singletons, rows shuffled; with
    `diverge`, two members of each group of 3+ also share one block past the group's prefix (so
    the longest common run is the group's). Returns tables, seq_lens, blocks in the pool."""
    rows: list[list[int]] = []
    lens: list[int] = []
    next_block = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    for members, shared in groups:
        prefix = fresh(shared)
        extra = fresh(1)
        for m in range(members):
            own = int(torch.randint(1, 3 * BS, (1,), generator=gen))
            blocks = -(-own // BS)
            tail = (
                extra + fresh(blocks - 1)
                if diverge and members >= 3 and m < 2 and blocks > 1
                else fresh(blocks)
            )
            rows.append(prefix + tail)
            lens.append(shared * BS + own)
    for _ in range(singles):
        n = int(torch.randint(1, 8 * BS, (1,), generator=gen))
        rows.append(fresh(-(-n // BS)))
        lens.append(n)
    # scatter the ids through a pool with spares, and shuffle the batch
    pool = torch.randperm(next_block + 5, generator=gen)
    order = torch.randperm(len(rows), generator=gen).tolist()
    width = max(len(r) for r in rows)
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, b in enumerate(order):
        tables[i, : len(rows[b])] = pool[rows[b]].to(torch.int32)
    return tables, [lens[b] for b in order], next_block + 5


GROUPS = [(5, 3), (2, 1), (3, 7), (9, 2)]


def test_find_groups_takes_the_longest_common_run() -> None:
    gen = torch.Generator().manual_seed(0)
    tables, lens, _ = make_tables(gen, GROUPS, singles=4)
    found = cascade.find_groups(tables, lens, BS)
    assert sorted((len(m), shared) for shared, m in found) == sorted(GROUPS)
    for shared, members in found:
        assert all((tables[b, :shared] == tables[members[0], :shared]).all() for b in members)
        assert all(shared * BS < lens[b] for b in members)
    # a member whose keys end inside the shared blocks caps the group's prefix below its last key
    tables = torch.tensor([[7, 8, 9], [7, 8, 9], [7, 8, 3]], dtype=torch.int32)
    assert cascade.find_groups(tables, [3 * BS, 2 * BS + 1, 2 * BS + 1], BS) == [(2, [0, 1, 2])]
    assert cascade.find_groups(tables, [3 * BS, BS + 1, 2 * BS], BS) == [(1, [0, 1, 2])]
    assert cascade.find_groups(tables, [3 * BS, BS, 2 * BS], BS) == [(1, [0, 2])]
    assert cascade.plan(tables, [BS, BS, BS], BS, forced=True) is None
    # several queries: the prefix ends before the first of them
    assert cascade.find_groups(tables, [3 * BS, 3 * BS, 3 * BS], BS, query_lens=[1, 1, 1]) == [
        (2, [0, 1, 2])
    ]
    assert cascade.find_groups(tables, [3 * BS, 3 * BS, 3 * BS], BS, query_lens=[1, 17, 1]) == [
        (1, [0, 1, 2])
    ]
    assert cascade.find_groups(tables, [3 * BS, 3 * BS, 3 * BS], BS, query_lens=[1, 33, 1]) == [
        (2, [0, 2])
    ]


def _case(
    gen: torch.Generator,
    dtype: torch.dtype,
    kv_heads: int,
    group: int,
    head_dim: int,
    most_queries: int = 1,
):
    """A batch over make_tables(GROUPS): one query a sequence, or with most_queries > 1 each
    sequence's last 1..most_queries tokens (at most its keys past one block), then its keys grown
    by as many so that the groups' shared blocks stay before every query."""
    tables, lens, blocks = make_tables(gen, GROUPS, singles=4)
    query_lens = [1] * len(lens)
    if most_queries > 1:
        query_lens = torch.randint(1, most_queries + 1, (len(lens),), generator=gen).tolist()
        grown = [n + q - 1 for n, q in zip(lens, query_lens)]
        extra = max(-(-n // BS) for n in grown) - tables.shape[1]
        tables = torch.cat([tables, torch.zeros(len(lens), max(extra, 0), dtype=torch.int32)], 1)
        for b, (n, m) in enumerate(zip(lens, grown)):  # fresh blocks for the grown keys
            for j in range(-(-n // BS), -(-m // BS)):
                tables[b, j] = blocks
                blocks += 1
        lens = grown
    shape = (blocks, kv_heads, BS, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(lens, dtype=torch.int32), tables, query_lens


def _attend(q, k, v, seq_lens, tables, scale, query_lens, **kw):
    """The kernel on the batch: its decode entry for one query a sequence, else varlen."""
    if all(n == 1 for n in query_lens):
        return kernel.paged_attention_decode(q, k, v, seq_lens, tables, scale, **kw)
    qsl = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    return kernel.paged_attention_varlen(q, k, v, qsl, seq_lens, tables, scale, **kw)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 128), (1, 8, 80)])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("most_queries", [1, 5, 40])
def test_cascade_equals_plain_kernel(
    dtype, kv_heads, group, head_dim, threads, most_queries, kernel_isa
) -> None:
    """Decode steps, speculative steps (a token and its drafts) and prompt chunks (40 tokens
    make several items of one sequence) after a shared prefix."""
    gen = torch.Generator().manual_seed(kv_heads * 100 + head_dim + most_queries)
    q, k, v, seq_lens, tables, qlens = _case(gen, dtype, kv_heads, group, head_dim, most_queries)
    plan = cascade.plan(tables, seq_lens.tolist(), BS, forced=True, query_lens=qlens)
    assert plan is not None and plan.num_groups == len(GROUPS)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = _attend(q, k, v, seq_lens, tables, 0.11, qlens)
        got = _attend(q, k, v, seq_lens, tables, 0.11, qlens, cascade=plan)
    finally:
        torch.set_num_threads(before)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), plain.float(), atol=tol, rtol=tol)
    want = cascade.reference(q, k, v, seq_lens.tolist(), tables, 0.11, plan, qlens)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("most_queries", [1, 40])
def test_cascade_soft_caps_shared_scores_too(dtype, most_queries, kernel_isa) -> None:
    """Gemma 2's soft-capped scores: the shared prefix's as each member's own."""
    gen = torch.Generator().manual_seed(most_queries)
    q, k, v, seq_lens, tables, qlens = _case(gen, dtype, 2, 4, 64, most_queries)
    plan = cascade.plan(tables, seq_lens.tolist(), BS, forced=True, query_lens=qlens)
    assert plan is not None
    plain = _attend(q, k, v, seq_lens, tables, 0.5, qlens, softcap=1.5)
    got = _attend(q, k, v, seq_lens, tables, 0.5, qlens, cascade=plan, softcap=1.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), plain.float(), atol=tol, rtol=tol)
    uncapped = _attend(q, k, v, seq_lens, tables, 0.5, qlens, cascade=plan)
    assert not torch.allclose(got.float(), uncapped.float(), atol=0.05)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("most_queries", [1, 5])
def test_cascade_reads_quantized_blocks_with_their_scales(
    cache_dtype, dtype, most_queries, kernel_isa
) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v, seq_lens, tables, qlens = _case(gen, torch.float32, 2, 3, 64, most_queries)
    q = q.to(dtype)
    stored, scales = {}, {}
    for name, values in (("k", k), ("v", v)):
        scale = torch.rand(values.shape[:3], generator=gen) * 0.05 + 0.001
        scaled = values / scale[..., None]
        stored[name] = (
            scaled.round().clamp(-127, 127)
            if cache_dtype == torch.int8
            else scaled.clamp(-448, 448)
        ).to(cache_dtype)
        scales[f"{name}_scales"] = scale
    plan = cascade.plan(tables, seq_lens.tolist(), BS, forced=True, query_lens=qlens)
    plain = _attend(q, stored["k"], stored["v"], seq_lens, tables, 0.125, qlens, **scales)
    got = _attend(
        q, stored["k"], stored["v"], seq_lens, tables, 0.125, qlens, cascade=plan, **scales
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), plain.float(), atol=tol, rtol=tol)
    # and the reference over the values the codes stand for (rotated back: a quantized cache
    # holds K and V rotated, attention/rotation.py, and the kernel rotates q in and its result back)
    deq = {
        n: unrotate(stored[n].float() * scales[f"{n}_scales"][..., None]).to(dtype)
        for n in ("k", "v")
    }
    want = cascade.reference(q, deq["k"], deq["v"], seq_lens.tolist(), tables, 0.125, plan, qlens)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: p.pre.__setitem__(p.members[0], 0), "shared prefix"),
        (lambda p: p.pre.__setitem__(p.members[0], 50), "shared prefix"),
        (lambda p: p.members.__setitem__(1, p.members[0]), "twice"),
        (lambda p: p.members.__setitem__(0, 999), "outside the batch"),
        (lambda p: p.group_start.__setitem__(1, 0), "empty"),
    ],
)
def test_bad_plans_are_refused_not_read(change, message: str) -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, seq_lens, tables, _ = _case(gen, torch.float32, 2, 2, 64)
    plan = cascade.plan(tables, seq_lens.tolist(), BS, forced=True)
    change(plan)
    with pytest.raises(ValueError, match=message):
        kernel.paged_attention_decode(q, k, v, seq_lens, tables, 0.1, cascade=plan)


@needs_kernel
def test_a_group_whose_tables_differ_is_refused() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v, seq_lens, tables, _ = _case(gen, torch.float32, 2, 2, 64)
    plan = cascade.plan(tables, seq_lens.tolist(), BS, forced=True)
    tables[plan.members[1], 0] += 1
    with pytest.raises(ValueError, match="does not share"):
        kernel.paged_attention_decode(q, k, v, seq_lens, tables, 0.1, cascade=plan)


@needs_kernel
def test_a_prefix_reaching_into_the_queries_is_refused() -> None:
    """A member's queries must all come after the shared blocks (they see every shared key)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, seq_lens, tables, qlens = _case(gen, torch.float32, 2, 2, 64, most_queries=3)
    plan = cascade.plan(tables, seq_lens.tolist(), BS, forced=True, query_lens=qlens)
    b = int(plan.members[0])
    longer = list(qlens)
    longer[b] = int(seq_lens[b]) - int(plan.pre[b]) * BS + 1  # its first query inside the prefix
    extra = longer[b] - qlens[b]
    q = torch.cat([q, torch.randn(extra, *q.shape[1:], generator=gen)])
    with pytest.raises(ValueError, match="before its queries"):
        _attend(q, k, v, seq_lens, tables, 0.1, longer, cascade=plan)


def test_mode_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CASCADE", "sometimes")
    with pytest.raises(ValueError, match="PAGEDKV_CASCADE"):
        cascade.mode()
    monkeypatch.setenv("PAGEDKV_CASCADE", "1")
    assert cascade.mode() == "1"


SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


@needs_kernel
@pytest.mark.parametrize("speculation", ["off", SPECULATION], ids=["plain", "speculative"])
def test_engine_outputs_are_unchanged_with_cascade_forced(
    tiny_model_dir, monkeypatch, speculation
) -> None:
    """Greedy and seeded samples forked from one prompt (sharing its blocks) decode alike with the
    cascade forced on and off, and the forced run does take the cascade (with speculation, in
    its steps of a token and its drafts too)."""
    from pagedkv import LLM

    prompt = (
        "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. " * 2
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
    ]
    used: dict[str, list[bool]] = {"decode": [], "varlen": []}  # with a plan or not, by kind
    attend = kernel.attend

    def spy(q, k, v, query_start_loc, *args, cascade=None, **kw):
        used["decode" if query_start_loc is None else "varlen"].append(cascade is not None)
        return attend(q, k, v, query_start_loc, *args, cascade=cascade, **kw)

    monkeypatch.setattr(kernel, "attend", spy)
    outputs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("PAGEDKV_CASCADE", mode)
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            block_size=4,
            num_gpu_blocks_override=256,
            speculative_config=speculation,
        )
        outs = llm.generate([prompt, prompt], params, use_tqdm=False)
        outputs[mode] = [[c.token_ids for c in o.outputs] for o in outs]
        assert any(used["decode"]) == (mode == "1")
        if speculation != "off":
            assert any(used["varlen"]) == (mode == "1")
            assert llm.engine.spec_stats.num_drafts > 0
        for calls in used.values():
            calls.clear()
    assert outputs["0"] == outputs["1"]
    assert len({tuple(t) for t in outputs["1"][1]}) > 1


def test_auto_keeps_only_groups_that_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    big, small_group, short = (
        (cascade.MIN_GROUP, cascade.MIN_BLOCKS),
        (2, cascade.MIN_BLOCKS + 2),
        (6, 2),
    )
    tables, lens, _ = make_tables(gen, [big, small_group, short], singles=2, diverge=False)
    plan = cascade.plan(tables, lens, BS, forced=False)
    assert plan is not None and plan.num_groups == 1
    assert sorted(set(plan.pre.tolist())) == [0, cascade.MIN_BLOCKS]
    assert cascade.plan(tables, lens, BS, forced=True).num_groups == 3
    monkeypatch.delenv("PAGEDKV_CASCADE", raising=False)
    assert cascade.mode() == "auto"


def test_auto_leaves_out_sequences_of_many_queries() -> None:
    """Long prompt chunks attend better as their own items; a token and its drafts join."""
    gen = torch.Generator().manual_seed(5)
    group = (cascade.MIN_GROUP, cascade.MIN_BLOCKS + 1)  # a block to spare for the queries
    tables, lens, _ = make_tables(gen, [group], singles=2, diverge=False)
    few = [cascade.MAX_QUERIES] * len(lens)
    plan = cascade.plan(tables, lens, BS, forced=False, query_lens=few)
    assert plan is not None and plan.num_groups == 1
    many = [cascade.MAX_QUERIES + 1] * len(lens)
    assert cascade.plan(tables, lens, BS, forced=False, query_lens=many) is None
    assert cascade.plan(tables, lens, BS, forced=True, query_lens=many) is not None

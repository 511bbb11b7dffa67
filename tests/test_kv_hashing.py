"""Chained block hashes: the hash itself, and each sequence's list of them, computed once.

A sequence's `BlockHashes` grows as its tokens arrive; grown token by token it equals the
tokens hashed at once, a fork continues its own copy, and in the engine every full block of
every sequence is hashed exactly once: not again while it waits at the head of the queue, not
after a preemption, and never for a speculative draft.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from pagedkv.config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.request import SamplingParams
from pagedkv.kv import hashing
from pagedkv.kv.hashing import BlockHashes, hash_block_tokens
from pagedkv.kv.manager import KVCacheManager

B = 4


def test_hash_is_chained_and_keyed():
    h0 = hash_block_tokens(None, [1, 2, 3], b"")
    assert isinstance(h0, bytes) and len(h0) == 32
    assert hash_block_tokens(None, [1, 2, 3], b"") == h0
    assert hash_block_tokens(None, [1, 2, 4], b"") != h0
    assert hash_block_tokens(None, [1, 2, 3], b"fp8") != h0
    assert hash_block_tokens(h0, [4, 5, 6], b"") != hash_block_tokens(None, [4, 5, 6], b"")
    other = hash_block_tokens(None, [9], b"")
    assert hash_block_tokens(h0, [4], b"") != hash_block_tokens(other, [4], b"")
    # token/extra boundary is unambiguous
    assert hash_block_tokens(None, [1], b"") != hash_block_tokens(
        None, [], (1).to_bytes(8, "little")
    )


def test_hash_is_stable_across_processes():
    code = (
        "from pagedkv.kv.hashing import hash_block_tokens as h; "
        "print(h(h(None,[1,2],b'x'),[3],b'x').hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    here = hash_block_tokens(hash_block_tokens(None, [1, 2], b"x"), [3], b"x").hex()
    assert outs == {here}
    # pinned: a change of layout would orphan every file of a disk tier
    assert here == GOLDEN


GOLDEN = "96f397a25b2efec2ac2eb994567a8968ff943677bd045558ef3bef8664c1ce8c"


def chain(tokens: list[int], extra: bytes = b"") -> list[bytes]:
    """The chained hashes of the full blocks, one hash_block_tokens call each."""
    out, parent = [], None
    for i in range(len(tokens) // B):
        parent = hash_block_tokens(parent, tokens[i * B : (i + 1) * B], extra)
        out.append(parent)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_grown_token_by_token_equals_hashed_at_once(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(rng.randrange(0, 60))]
    grown = BlockHashes(B, b"k", tokens[:3])
    for n in range(3, len(tokens) + 1):
        grown.update(tokens[:n])
        assert len(grown) == n // B and grown.num_tokens == n
    if len(tokens) < 3:
        grown = BlockHashes(B, b"k", tokens)
    at_once = BlockHashes(B, b"k", tokens)
    assert grown.hashes == at_once.hashes == chain(tokens, b"k")
    assert grown.chunks == at_once.chunks
    assert at_once.chunks == [tuple(tokens[i * B : (i + 1) * B]) for i in range(len(tokens) // B)]


def test_update_hashes_only_new_full_blocks(monkeypatch):
    calls = []
    real = hashing.hash_block_tokens
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda *a: calls.append(a) or real(*a))
    tokens = list(range(2 * B + 1))
    hashes = BlockHashes(B, b"", tokens)
    assert len(calls) == 2
    for t in range(2 * B + 1, 3 * B - 1):  # the third block fills at its last token only
        tokens.append(t)
        hashes.update(tokens)
        assert len(calls) == 2
    tokens.append(99)
    hashes.update(tokens)
    assert len(calls) == 3 and calls[-1][1] == tuple(tokens[2 * B : 3 * B])
    hashes.update(tokens, 3 * B)  # the same count again: nothing to do
    assert len(calls) == 3
    with pytest.raises(ValueError, match="only grows"):
        hashes.update(tokens[:B])


def test_a_prefix_of_the_tokens_and_a_fork_copy():
    tokens = list(range(5 * B))
    part = BlockHashes(B, b"", tokens, 2 * B + 1)
    assert part.num_tokens == 2 * B + 1 and part.hashes == chain(tokens[: 2 * B])
    child = part.copy()
    child.update([*tokens[: 2 * B + 1], 7, 7, 7])  # the child's own tokens
    part.update(tokens[: 3 * B])
    assert part.hashes == chain(tokens[: 3 * B])
    assert child.hashes == chain([*tokens[: 2 * B + 1], 7, 7, 7])
    assert child.hashes[:2] == part.hashes[:2] and child.hashes[2] != part.hashes[2]


def test_prefix_caching_off_hashes_nothing(monkeypatch):
    monkeypatch.setattr(hashing, "hash_block_tokens", None)  # any call would fail
    off = KVCacheManager(8, B, enable_prefix_caching=False).block_hashes(list(range(3 * B)))
    off.update(list(range(4 * B)))
    assert len(off) == 0 and off.num_tokens == 4 * B


def test_the_manager_refuses_hashes_of_another_pool():
    m = KVCacheManager(8, B, hash_extra=b"fp8")
    with pytest.raises(ValueError, match="another pool"):
        m.allocate_slots("a", BlockHashes(B, b"auto", list(range(B))), B)
    with pytest.raises(ValueError, match="another pool"):
        m.lookup_prefix(BlockHashes(2 * B, b"fp8", list(range(B))))
    assert not m.has_request("a")


# ---- in the engine: each full block of each sequence is hashed once -------------------------


def counted(monkeypatch) -> list[int]:
    calls = [0]
    real = hashing.hash_block_tokens

    def count(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(hashing, "hash_block_tokens", count)
    return calls


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Run to the end; the groups, and how many steps left a request waiting at the queue's head."""
    groups = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    waited = 0
    while engine.has_unfinished():
        engine.step()
        waited += bool(engine.scheduler.waiting)
    return groups, waited


def expected_hash_calls(engine: LLMEngine, groups) -> int:
    """Each sequence's full blocks once; a forked sample shares its parent's prompt blocks."""
    bs, total = engine.kv.block_size, 0
    for group in groups:
        for seq in group.seqs:
            total += len(seq.token_ids) // bs
            if seq.index > 0:
                total -= len(group.prompt_token_ids) // bs
            fresh = engine.kv.block_hashes(seq.token_ids)
            assert seq.block_hashes.hashes == fresh.hashes, seq.seq_id
    return total


def test_waiting_and_preempted_sequences_are_hashed_once(tiny_model_dir, monkeypatch):
    """A pool for about two requests: the rest wait at the head of the queue for many steps, and
    running ones are preempted (recompute); yet no block is hashed twice."""
    engine = LLMEngine(
        EngineConfig.from_options(
            model=tiny_model_dir, dtype="float32", block_size=B, num_gpu_blocks_override=24
        )
    )
    calls = counted(monkeypatch)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(30 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=14, ignore_eos=True)
    groups, waited = run_engine(engine, prompts, params)
    assert waited >= 10 and engine.scheduler.num_preemptions > 0
    assert calls[0] == expected_hash_calls(engine, groups)


def test_speculative_drafts_are_never_hashed(tiny_model_dir, monkeypatch):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    engine = LLMEngine(
        EngineConfig.from_options(
            model=tiny_model_dir,
            dtype="float32",
            block_size=B,
            num_gpu_blocks_override=64,
            speculative_config=spec,
        )
    )
    calls = counted(monkeypatch)
    rng = random.Random(1)
    motifs = [[rng.randrange(3, 500) for _ in range(3)] for _ in range(4)]
    prompts = [m * 6 for m in motifs]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) for _ in prompts]
    groups, _ = run_engine(engine, prompts, params)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts were rejected
    assert calls[0] == expected_hash_calls(engine, groups)


def test_a_cache_salt_keys_every_block_through_the_first():
    """Different salts share no block hash; no salt hashes as before (a disk tier's files keep
    their names)."""
    tokens = list(range(3 * B))
    plain = BlockHashes(B, b"x", tokens)
    assert plain.hashes[0] == hash_block_tokens(None, tokens[:B], b"x")
    a, a_again, b = (BlockHashes(B, b"x", tokens, salt=s) for s in ("a", "a", "b"))
    assert a.hashes == a_again.hashes
    for one, other in ((a, plain), (a, b)):
        assert not set(one.hashes) & set(other.hashes)
    assert BlockHashes(B, b"", tokens, salt="x").hashes != plain.hashes  # not the pool's extra
    fork = a.copy()
    for seq in (a, fork):
        seq.update(tokens + [7] * B)
    assert fork.hashes == a.hashes == BlockHashes(B, b"x", tokens + [7] * B, salt="a").hashes

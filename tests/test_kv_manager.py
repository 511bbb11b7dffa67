"""KVCacheManager rules, one test each: exact block ids, ref counts, LRU order, CoW, reservations,
swap."""

import json

import pytest

from pagedkv.config import ConfigError
from pagedkv.kv import BlockCopy, KVCacheManager, PrefixMatch

B = 4


class Checked:
    """Wraps a manager so every call is followed by the full integrity audit."""

    def __init__(self, m: KVCacheManager):
        self.m = m

    def __getattr__(self, name):
        attr = getattr(self.m, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*args, **kwargs)
            self.m.check_integrity()
            return out

        return call


def make(num_blocks=16, **kw) -> Checked:
    kw.setdefault("watermark", 0.0)
    return Checked(KVCacheManager(num_blocks, B, **kw))


def toks(n, start=0):
    return list(range(start, start + n))


def refs(m, block_ids):
    return [m.pool.blocks[i].ref_count for i in block_ids]


def queue(m):
    return [b.block_id for b in m.pool.free_queue]


def lookup(m, tokens) -> list[int]:
    """The device blocks lookup_prefix offers for these tokens."""
    return list(m.lookup_prefix(m.block_hashes(tokens)).block_ids)


def offer(block_ids) -> PrefixMatch:
    return PrefixMatch(tuple(block_ids))


def admit(m, rid, tokens, **kw):
    hashes = m.block_hashes(tokens)
    prefix = m.lookup_prefix(hashes)
    out = m.allocate_slots(rid, hashes, len(tokens) - prefix.num_blocks * B, prefix=prefix, **kw)
    return list(prefix.block_ids), out


def test_admission_takes_blocks_on_demand_in_queue_order():
    m = make()
    assert m.allocate_slots("a", m.block_hashes(toks(10)), 10) == []
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_computed_tokens("a") == 10 and m.num_cached_tokens("a") == 0
    assert m.num_free_blocks() == 13 and m.usage() == pytest.approx(3 / 16)
    # chunked: hold only part of what is known, then the rest
    assert m.allocate_slots("b", m.block_hashes(toks(10, 100)), 3) == []
    assert m.block_table("b") == [3] and m.num_computed_tokens("b") == 3
    assert m.allocate_slots("b", m.block_hashes(toks(10, 100)), 7) == []
    assert m.block_table("b") == [3, 4, 5]


def test_decode_takes_a_new_block_only_at_the_boundary():
    m = make()
    t = toks(3)
    m.allocate_slots("a", m.block_hashes(t), 3)
    for n in range(4, 10):
        t.append(n)
        assert m.allocate_slots("a", m.block_hashes(t), 1) == []
        assert len(m.block_table("a")) == -(-n // B)
    assert m.block_table("a") == [0, 1, 2] and m.num_computed_tokens("a") == 9


def test_common_three_block_prefix_is_held_once():
    m = make()
    shared = toks(3 * B)
    _, out = admit(m, "a", shared + [100, 101])
    assert out == [] and m.block_table("a") == [0, 1, 2, 3]
    prefix, out = admit(m, "b", shared + [200])
    assert prefix == [0, 1, 2] and out == []
    assert m.block_table("b") == [0, 1, 2, 4]
    assert refs(m, [0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    assert m.num_cached_tokens("b") == 3 * B and m.num_computed_tokens("b") == 3 * B + 1
    st = m.stats()
    assert st.used == 5 and st.shared == 3
    assert st.prefix_queries == 14 + 13 and st.prefix_hits == 12
    assert st.tokens_held == 14 + 1  # the shared 12 tokens count once


def test_lookup_never_covers_the_last_token():
    m = make()
    t = toks(3 * B)
    m.allocate_slots("a", m.block_hashes(t), len(t))
    assert lookup(m, t) == [0, 1]
    assert lookup(m, t + [99]) == [0, 1, 2]
    assert lookup(m, toks(2 * B) + [7] * B + [1]) == [0, 1]  # stops at the first mismatch
    assert lookup(m, [5] + t[1:]) == []  # chained: no match after a change
    assert lookup(m, []) == []


def test_lookup_is_pure():
    m = make()
    m.allocate_slots("a", m.block_hashes(toks(9)), 9)
    m.free("a")
    before, q = m.snapshot(), queue(m)
    assert lookup(m, toks(9)) == [0, 1]
    assert m.snapshot() == before and queue(m) == q


def test_freed_blocks_stay_findable_and_are_revived():
    m = make(num_blocks=6)
    t = toks(2 * B + 1)
    m.allocate_slots("a", m.block_hashes(t), len(t))
    m.free("a")
    assert m.stats().cached == 2 and m.stats().used == 0
    prefix, _ = admit(m, "b", t)
    assert prefix == [0, 1] and m.block_table("b") == [0, 1, 3]
    assert refs(m, [0, 1]) == [1, 1] and 0 not in queue(m)


def test_stale_prefix_blocks_are_revalidated():
    m = make(num_blocks=4)
    t = toks(2 * B + 1)
    m.allocate_slots("a", m.block_hashes(t), len(t))
    m.free("a")  # queue: 3, 2, 1, 0 (tail first)
    prefix = lookup(m, t)
    assert prefix == [0, 1] and queue(m) == [3, 2, 1, 0]
    m.allocate_slots("x", m.block_hashes(toks(3 * B, 500)), 3 * B)  # evicts 3, 2, 1
    assert m.block_table("x") == [3, 2, 1]
    m.free("x")  # queue: 0, 1, 2, 3
    assert m.allocate_slots("b", m.block_hashes(t), len(t) - 2 * B, prefix=offer(prefix)) == []
    assert m.num_cached_tokens("b") == B  # only block 0 still matched
    assert m.num_computed_tokens("b") == B + 1  # num_new_tokens counts from the valid prefix
    assert m.block_table("b") == [0, 1]
    assert (
        m.allocate_slots("c", m.block_hashes(toks(5, 900)), 5, prefix=offer([7, 8])) == []
    )  # bogus ids are ignored
    assert m.num_cached_tokens("c") == 0 and m.block_table("c") == [2, 3]


def test_free_is_tail_first_and_eviction_is_lru():
    m = make(num_blocks=8)
    m.allocate_slots("a", m.block_hashes(toks(3 * B)), 3 * B)  # blocks 0 1 2
    m.allocate_slots("b", m.block_hashes(toks(2 * B, 100)), 2 * B)  # blocks 3 4
    m.free("b")
    m.free("a")
    assert queue(m) == [5, 6, 7, 4, 3, 2, 1, 0]
    m.allocate_slots("c", m.block_hashes(toks(5 * B, 200)), 5 * B)
    assert m.block_table("c") == [5, 6, 7, 4, 3]  # b's blocks evicted before a's
    assert lookup(m, toks(2 * B, 100) + [0]) == []
    assert lookup(m, toks(3 * B) + [0]) == [0, 1, 2]
    m.allocate_slots("d", m.block_hashes(toks(B, 300)), B)
    assert m.block_table("d") == [2]  # a's tail block goes first, its prefix lives on
    assert lookup(m, toks(3 * B) + [0]) == [0, 1]


def test_hit_moves_block_to_most_recently_used():
    m = make(num_blocks=4)
    m.allocate_slots("a", m.block_hashes(toks(B)), B)
    m.allocate_slots("b", m.block_hashes(toks(B, 100)), B)
    m.free("a")
    m.free("b")  # queue 2 3 0 1
    admit(m, "c", toks(B) + [1])  # hits block 0
    m.free("c")  # c frees 2 then 0 -> tail
    assert queue(m) == [3, 1, 2, 0]


def test_fork_copies_the_half_full_last_block_once():
    m = make()
    t = toks(2 * B + 2)
    m.allocate_slots("p", m.block_hashes(t), len(t))  # [0 full][1 full][2 half]
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1, 2] and refs(m, [0, 1, 2]) == [2, 2, 2]
    assert m.num_computed_tokens("c") == len(t)
    ct = t + [50]
    assert m.allocate_slots("c", m.block_hashes(ct), 1) == [BlockCopy(src=2, dst=3)]
    assert m.block_table("c") == [0, 1, 3] and refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    ct.append(51)
    assert m.allocate_slots("c", m.block_hashes(ct), 1) == []  # private now: no second copy
    assert (
        m.allocate_slots("p", m.block_hashes(t + [60]), 1) == []
    )  # parent's block is no longer shared
    assert m.block_table("p") == [0, 1, 2]


def test_fork_with_full_last_block_needs_no_copy():
    m = make()
    t = toks(2 * B)
    m.allocate_slots("p", m.block_hashes(t), len(t))
    m.fork("p", "c")
    assert m.allocate_slots("c", m.block_hashes(t + [9]), 1) == []
    assert m.block_table("c") == [0, 1, 2] and m.block_table("p") == [0, 1]


def test_fork_errors():
    m = make()
    m.allocate_slots("p", m.block_hashes(toks(3)), 3)
    with pytest.raises(ValueError, match="already exists"):
        m.fork("p", "p")
    with pytest.raises(KeyError):
        m.fork("nope", "x")


def test_cow_without_room_changes_nothing():
    m = make(num_blocks=2)
    m.allocate_slots("p", m.block_hashes(toks(B + 1)), B + 1)
    m.fork("p", "c")
    before = m.snapshot()
    assert m.allocate_slots("c", m.block_hashes(toks(B + 2)), 1) is None
    assert m.snapshot() == before


def test_reserve_max_takes_max_model_len_at_admission():
    m = make(num_blocks=16, allocation_policy="reserve-max", max_model_len=6 * B)
    assert m.allocate_slots("a", m.block_hashes(toks(3)), 3) == []
    assert m.block_table("a") == [0, 1, 2, 3, 4, 5]
    t = toks(3)
    for n in range(3, 6 * B):
        t.append(n)
        assert m.allocate_slots("a", m.block_hashes(t), 1) == []
    assert m.block_table("a") == [0, 1, 2, 3, 4, 5]
    st = m.stats()
    assert st.used == 6 and st.tokens_held == 6 * B
    assert m.can_fit(1) and not make(
        num_blocks=5, allocation_policy="reserve-max", max_model_len=6 * B
    ).can_fit(1)


def test_reserve_output_takes_prompt_plus_max_tokens():
    m = make(num_blocks=16, allocation_policy="reserve-output")
    assert m.allocate_slots("a", m.block_hashes(toks(5)), 5, max_tokens=6) == []
    assert m.block_table("a") == [0, 1, 2]  # ceil(11 / 4)
    st = m.stats()
    assert st.tokens_held == 5 and st.token_slots == 12
    assert st.token_utilization == pytest.approx(5 / 12)
    m.allocate_slots("a", m.block_hashes(toks(13)), 8)  # past the reservation: paged growth
    assert m.block_table("a") == [0, 1, 2, 3]


def test_fork_under_reservation_takes_fresh_block_for_empty_shared_one():
    m = make(allocation_policy="reserve-output")
    m.allocate_slots("p", m.block_hashes(toks(B)), B, max_tokens=B)  # [0 full][1 empty reserved]
    m.fork("p", "c")
    assert (
        m.allocate_slots("c", m.block_hashes(toks(B + 1)), 1) == []
    )  # nothing to copy into the fresh block
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]


def test_watermark_applies_to_admission_only():
    m = make(num_blocks=20, watermark=0.1)  # keep 2 blocks free at admission
    assert m.allocate_slots("a", m.block_hashes(toks(17 * B)), 17 * B) == []
    assert m.can_allocate(m.block_hashes(toks(B, 100)), B)  # 3 free: 1 taken, 2 left
    assert m.allocate_slots("a", m.block_hashes(toks(18 * B)), B) == []
    assert (
        m.allocate_slots("b", m.block_hashes(toks(B, 100)), B) is None
    )  # would leave 1 free, under the watermark
    assert not m.can_allocate(m.block_hashes(toks(B, 100)), B)
    assert (
        m.allocate_slots("a", m.block_hashes(toks(20 * B)), 2 * B) == []
    )  # running requests may use it
    assert m.num_free_blocks() == 0
    assert not m.can_fit(19 * B) and m.can_fit(18 * B)


def test_request_larger_than_pool_gets_none_and_nothing_changes():
    m = make(num_blocks=4)
    m.allocate_slots("a", m.block_hashes(toks(B + 1)), B + 1)
    m.free("a")
    before = m.snapshot()
    q = queue(m)
    assert not m.can_fit(5 * B)
    assert admit(m, "big", toks(B) + toks(5 * B, 1000))[1] is None
    assert m.snapshot() == before and queue(m) == q
    assert not m.has_request("big")
    m.allocate_slots("x", m.block_hashes(toks(B)), B)
    with pytest.raises(ValueError):
        m.allocate_slots("x", m.block_hashes(toks(B)), 1)  # needs more token ids than given


def test_swap_out_and_in_reuse_cached_blocks():
    m = make(num_blocks=8, num_host_blocks=4)
    t = toks(2 * B + 1)
    m.allocate_slots("a", m.block_hashes(t), len(t))  # [0 full][1 full][2 1/4]
    assert m.can_swap_out("a")
    assert m.swap_out("a") == [BlockCopy(0, 0), BlockCopy(1, 1), BlockCopy(2, 2)]
    assert m.is_swapped("a") and m.block_table("a") == [] and m.num_computed_tokens("a") == len(t)
    assert m.stats().host_free == 1 and m.usage() == 0
    assert lookup(m, t) == [0, 1]  # hashes kept while swapped
    plan = m.swap_in("a")
    assert plan == [BlockCopy(src=2, dst=3)]  # only the unhashed block comes from host
    assert m.block_table("a") == [0, 1, 3] and not m.is_swapped("a")
    assert m.stats().host_free == 4


def test_swap_in_copies_blocks_evicted_meanwhile_and_rehashes_them():
    m = make(num_blocks=4, num_host_blocks=4)
    t = toks(2 * B + 1)
    m.allocate_slots("a", m.block_hashes(t), len(t))
    m.swap_out("a")  # host 0 1 2; queue: 3, 2, 1, 0
    m.allocate_slots("x", m.block_hashes(toks(3 * B, 500)), 3 * B)  # evicts hashed block 1, keeps 0
    m.free("x")  # queue: 0, 1, 2, 3
    assert lookup(m, t) == [0]
    assert m.swap_in("a") == [BlockCopy(src=1, dst=1), BlockCopy(src=2, dst=2)]
    assert m.block_table("a") == [0, 1, 2]
    assert lookup(m, t) == [0, 1]  # the copied full block is findable again


def test_swap_without_room_changes_nothing():
    m = make(num_blocks=4, num_host_blocks=2)
    m.allocate_slots("a", m.block_hashes(toks(2 * B + 1)), 2 * B + 1)
    before = m.snapshot()
    assert not m.can_swap_out("a") and m.swap_out("a") is None
    assert m.snapshot() == before
    m2 = make(num_blocks=4, num_host_blocks=4, enable_prefix_caching=False)
    m2.allocate_slots("a", m2.block_hashes(toks(2 * B + 1)), 2 * B + 1)
    m2.swap_out("a")
    m2.allocate_slots("b", m2.block_hashes(toks(2 * B)), 2 * B)
    before = m2.snapshot()
    assert m2.swap_in("a") is None
    assert m2.snapshot() == before and m2.is_swapped("a")
    with pytest.raises(ValueError):
        m2.allocate_slots("a", m2.block_hashes(toks(2 * B + 2)), 1)
    m2.free("a")  # a swapped request gives back its host blocks
    assert m2.stats().host_free == 4


def test_prefix_caching_off():
    m = make(enable_prefix_caching=False)
    t = toks(3 * B)
    m.allocate_slots("a", m.block_hashes(t), len(t))
    assert lookup(m, t + [1]) == [] and m.pool.cached == {}
    assert m.allocate_slots("b", m.block_hashes(t + [1]), 1, prefix=offer([0, 1])) == []
    assert m.num_cached_tokens("b") == 0 and m.block_table("b") == [3]
    st = m.stats()
    assert st.prefix_queries == 0 and st.prefix_hits == 0


def test_hash_extra_separates_caches():
    a = KVCacheManager(4, B, hash_extra=b"fp8")
    b = KVCacheManager(4, B, hash_extra=b"auto")
    for m in (a, b):
        m.allocate_slots("r", m.block_hashes(toks(B)), B)
    assert set(a.pool.cached).isdisjoint(b.pool.cached)


def test_reset_prefix_cache():
    m = make()
    m.allocate_slots("a", m.block_hashes(toks(2 * B)), 2 * B)
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert lookup(m, toks(2 * B + 1)) == [] and m.stats().cached == 0


def test_stats_and_snapshot():
    m = make(num_blocks=6, num_host_blocks=2)
    m.allocate_slots("a", m.block_hashes(toks(B + 2)), B + 2)
    m.fork("a", "b")
    m.allocate_slots("c", m.block_hashes(toks(B, 50)), B)
    m.free("c")
    snap = m.snapshot()
    json.dumps(snap)
    assert (snap["num_blocks"], snap["free"], snap["cached"], snap["used"], snap["shared"]) == (
        6,
        4,
        1,
        2,
        2,
    )
    assert snap["tokens_held"] == B + 2 and snap["token_slots"] == 2 * B
    assert snap["num_requests"] == 2 and snap["host_free"] == 2
    assert snap["blocks"][1] == {
        "id": 1,
        "state": "used",
        "ref_count": 2,
        "fill": 2,
        "owners": ["a", "b"],
    }
    assert snap["blocks"][2]["state"] == "cached" and snap["blocks"][3]["state"] == "free"
    assert snap["requests"]["b"] == {
        "block_table": [0, 1],
        "num_tokens": B + 2,
        "num_cached_tokens": 0,
        "swapped": False,
    }


def test_free_unknown_is_noop_and_queries_raise():
    m = make()
    m.free("ghost")
    assert m.num_free_blocks() == 16 and not m.has_request("ghost")
    with pytest.raises(KeyError):
        m.num_computed_tokens("ghost")


@pytest.mark.parametrize(
    "kw",
    [
        dict(allocation_policy="nope"),
        dict(allocation_policy="reserve-max"),
        dict(watermark=1.0),
        dict(num_host_blocks=-1),
    ],
)
def test_bad_configuration_is_a_config_error(kw):
    with pytest.raises(ConfigError):
        KVCacheManager(8, B, **kw)
    with pytest.raises(ConfigError):
        KVCacheManager(0, B)

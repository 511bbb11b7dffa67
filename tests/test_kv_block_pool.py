"""BlockPool and FreeBlockQueue: exact ids, ref counts, queue order, eviction, audit."""

import pytest

from pagedkv.kv.block_pool import Block, BlockPool, FreeBlockQueue
from pagedkv.kv.hashing import hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_ids(pool):
    return ids(pool.free_queue)


def test_free_queue_popleft_append_remove_keep_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and blocks[2].prev is None and blocks[2].next is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 4, 2, 0] and len(q) == 5
    q.remove(blocks[0])  # tail end
    q.remove(blocks[1])  # head end
    assert ids(q) == [3, 4, 2] and len(q) == 3


def test_free_queue_popleft_on_empty_raises():
    q = FreeBlockQueue()
    with pytest.raises(IndexError):
        q.popleft()
    assert len(q) == 0 and q.head.next is q.tail


def test_get_new_blocks_pops_from_head_with_ref_one():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_count for b in got] == [1, 1, 1]
    assert queue_ids(pool) == [3, 4, 5] and pool.num_free == 3
    pool.check_integrity()


def test_free_blocks_append_to_tail_in_given_order():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([c, a, b])
    assert queue_ids(pool) == [3, 2, 0, 1]
    pool.check_integrity()
    assert ids(pool.get_new_blocks(2)) == [3, 2]


def test_shared_block_returns_to_queue_only_at_ref_zero():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_count == 2
    pool.free_blocks([b])
    assert b.ref_count == 1 and 0 not in queue_ids(pool)
    pool.check_integrity()
    pool.free_blocks([b])
    assert b.ref_count == 0 and queue_ids(pool) == [1, 2, 0]
    pool.check_integrity()


def test_touch_revives_cached_free_block_from_middle_of_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    h = hash_block_tokens(None, [1, 2], b"")
    pool.cache_full_block(blocks[2], h, (1, 2))
    pool.free_blocks(blocks)
    assert queue_ids(pool) == [0, 1, 2, 3, 4]
    hit = pool.get_cached_block(h, (1, 2))
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_count == 1 and queue_ids(pool) == [0, 1, 3, 4]
    assert pool.cached[h] is hit  # still cached while in use
    pool.check_integrity()


def test_eviction_pops_lru_head_drops_hash_and_calls_hook():
    evicted = []
    pool = BlockPool(3, on_evict=lambda bid, h: evicted.append((bid, h)))
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i], b"") for i in range(3)]
    for block, h, t in zip(blocks, hashes, range(3)):
        pool.cache_full_block(block, h, (t,))
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])  # LRU: 1, 2, 0
    got = pool.get_new_blocks(2)
    assert ids(got) == [1, 2]
    assert evicted == [(1, hashes[1]), (2, hashes[2])]
    assert got[0].block_hash is None and got[0].token_ids is None
    assert set(pool.cached) == {hashes[0]}
    assert pool.get_cached_block(hashes[1], (1,)) is None
    pool.check_integrity()


def test_get_cached_block_compares_token_ids():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [5, 6], b"")
    pool.cache_full_block(b, h, (5, 6))
    assert pool.get_cached_block(h, (5, 6)) is b
    assert pool.get_cached_block(h, (5, 7)) is None  # a forged collision never hands out wrong K/V


def test_duplicate_content_keeps_first_block_findable():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1], b"")
    pool.cache_full_block(a, h, (1,))
    pool.cache_full_block(b, h, (1,))
    assert pool.cached[h] is a and b.block_hash is None
    pool.check_integrity()


def test_asking_for_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert queue_ids(pool) == [2] and pool.num_free == 1
    pool.check_integrity()


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1], b"")
    pool.cache_full_block(b, h, (1,))
    assert pool.reset_prefix_cache() is False and pool.cached[h] is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and b.block_hash is None
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    b.ref_count = 0  # neither free nor referenced
    with pytest.raises(AssertionError, match="neither free nor referenced"):
        pool.check_integrity()
    pool = BlockPool(3)
    pool.blocks[1].ref_count = 2  # in the queue yet referenced
    with pytest.raises(AssertionError, match="free block 1"):
        pool.check_integrity()
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.cached[hash_block_tokens(None, [1], b"")] = b  # map entry with wrong hash
    with pytest.raises(AssertionError, match="another hash"):
        pool.check_integrity()

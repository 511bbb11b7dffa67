"""The one walk over a sequence's block hashes: how far the device prefix cache matches it, then
how far the offload tiers (host memory, then disk) continue the chain.

    hashes     h0   h1   h2   h3   h4   h5 | last token: never matched (it is always computed)
    device     hit  hit  miss
    tiers                hit  hit  miss
    match      block_ids (2), num_offloaded (2)

Lookup (`KVCacheManager.lookup_prefix`) walks both; admission re-checks what lookup offered with
the same two runs. Both read hashes computed once per sequence (`BlockHashes`): no token is
re-hashed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.kv.block_pool import Block, BlockPool
from pagedkv.kv.hashing import BlockHashes
from pagedkv.kv.plan import OffloadTiers


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A sequence's reusable prefix: cached device blocks, then the blocks right after them that an
    offload tier holds (loaded into fresh device blocks at admission)."""

    block_ids: tuple[int, ...] = ()
    num_offloaded: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + self.num_offloaded


NO_PREFIX = PrefixMatch()


def match_prefix(hashes: BlockHashes, pool: BlockPool, tiers: OffloadTiers | None) -> PrefixMatch:
    """The leading run of the sequence's full blocks that the device pool caches, then the run
    right after it that the tiers hold. Never covers the last token. Pure: changes nothing,
    counts nothing."""
    blocks = cached_run(hashes, pool, len(hashes))
    num_offloaded = tier_run(hashes, tiers, len(blocks), len(hashes))
    return PrefixMatch(tuple(block.block_id for block in blocks), num_offloaded)


def matchable(hashes: BlockHashes) -> int:
    """How many leading blocks a match may cover: the full ones, short of the last token."""
    if hashes.block_size is None:
        return 0
    return min(len(hashes), (hashes.num_tokens - 1) // hashes.block_size)


def cached_run(hashes: BlockHashes, pool: BlockPool, max_blocks: int) -> list[Block]:
    """The device pool's cached blocks for the sequence's first blocks, up to the first miss."""
    keys, chunks = hashes.hashes, hashes.chunks
    blocks: list[Block] = []
    for i in range(min(max_blocks, matchable(hashes))):
        block = pool.get_cached_block(keys[i], chunks[i])
        if block is None:
            break
        blocks.append(block)
    return blocks


def tier_run(hashes: BlockHashes, tiers: OffloadTiers | None, start: int, max_blocks: int) -> int:
    """How many of the sequence's blocks from `start` on the tiers hold, up to the first miss."""
    if tiers is None:
        return 0
    keys, chunks = hashes.hashes, hashes.chunks
    stop = min(start + max_blocks, matchable(hashes))
    i = start
    while i < stop and tiers.contains(keys[i], chunks[i]):
        i += 1
    return i - start

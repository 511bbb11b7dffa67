"""Swap a request's blocks to host memory and back (preemption by swapping).

Swap-out copies every block holding tokens to a host slot and frees the device
blocks; the cached ones stay findable in the prefix cache meanwhile. Swap-in
reuses each block still cached on the device instead of copying it back, and
re-registers the copied ones, so a swap never loses a prefix-cache entry it
can keep.
"""

from __future__ import annotations

from pagedkv.config import ConfigError
from pagedkv.kv.block_pool import Block, BlockPool, HostBlockPool, HostPool
from pagedkv.kv.plan import BlockCopy, OffloadTiers
from pagedkv.kv.table import RequestBlocks, SwappedBlock, cdiv


def host_pool(num_host_blocks: int, offload: OffloadTiers | None) -> HostPool:
    """The swap space: num_host_blocks of plain host memory, or the offload host tier's slots."""
    if num_host_blocks < 0:
        raise ConfigError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
    if offload is None or offload.host is None:
        return HostBlockPool(num_host_blocks)
    if num_host_blocks:
        raise ConfigError(
            "swap space and an offload host tier are one pool: give num_host_blocks=0"
        )
    return offload.host


def fits_host(req: RequestBlocks, host: HostPool, block_size: int) -> bool:
    """Can this running request swap out now (host room for every block holding tokens)?"""
    return req.swapped is None and cdiv(req.num_tokens, block_size) <= host.num_free()


def swap_out(
    req: RequestBlocks, pool: BlockPool, host: HostPool, block_size: int
) -> list[BlockCopy] | None:
    """Plan device->host copies of the blocks holding tokens and free the device blocks. None,
    and no change, if the host pool is too small."""
    if not fits_host(req, host, block_size):
        return None
    filled = cdiv(req.num_tokens, block_size)
    hosts = iter(host.take(filled))
    copies: list[BlockCopy] = []
    swapped: list[SwappedBlock] = []
    for i, block in enumerate(req.blocks):
        if i >= filled:  # reserved, empty: nothing to keep
            swapped.append(SwappedBlock(None, None))
            continue
        slot = next(hosts)
        copies.append(BlockCopy(block.block_id, slot))
        cached = None
        if block.block_hash is not None and block.token_ids is not None:
            cached = (block.block_hash, block.token_ids)
        swapped.append(SwappedBlock(slot, cached))
    pool.free_blocks(reversed(req.blocks))
    req.blocks = []
    req.swapped = swapped
    return copies


def swap_in(req: RequestBlocks, pool: BlockPool, host: HostPool) -> list[BlockCopy] | None:
    """Plan host->device copies back. Blocks whose content is still cached on the device are
    reused instead of copied. None, and no change, if the device pool is too small."""
    assert req.swapped is not None
    reuse = [pool.get_cached_block(*b.cached) if b.cached else None for b in req.swapped]
    num_fresh = reuse.count(None)
    revived = sum(1 for block in reuse if block is not None and block.ref_count == 0)
    if num_fresh + revived > pool.num_free:
        return None
    pool.touch(block for block in reuse if block is not None)
    fresh = iter(pool.get_new_blocks(num_fresh))
    copies: list[BlockCopy] = []
    table: list[Block] = []
    for swapped, block in zip(req.swapped, reuse):
        if block is None:
            block = next(fresh)
            if swapped.host is not None:
                copies.append(BlockCopy(swapped.host, block.block_id))
            if swapped.cached is not None:
                pool.cache_full_block(block, *swapped.cached)
        table.append(block)
    host.release(b.host for b in req.swapped if b.host is not None)
    req.blocks = table
    req.swapped = None
    return copies

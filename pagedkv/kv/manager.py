"""Per-request block tables over the BlockPool: admission, append, prefix reuse, fork (CoW), swap.

A request's block table maps logical block i (tokens i*B .. i*B+B-1) to a
physical block; only the last block in use may be partly filled:

    request "a", 37 tokens, B = 16      logical:   0        1        2
                                        physical: [12 full][3 full ][40 5/16]
    fork -> "b" shares 12, 3, 40; the first write of either into 40 gets a
    private copy of it and a BlockCopy(src=40, dst=new) for the runner.

Every method that returns BlockCopy lists describes data the runner must copy
before the next forward pass. Apply them in the order the calls were made: a
block freed by one call may be the destination of a later one.

With offload tiers (`pagedkv.kv.plan.OffloadTiers`), a cached block the pool
evicts is recorded as a BlockSave (its data must reach the tier before anything
overwrites it this step), and admission continues the prefix match in the tiers:
those blocks get fresh device blocks, count as prefix hits and come back as
BlockLoad. With a disk tier, every block that becomes full is also recorded, to
be written through once the step's forward has filled it. `take_offload_plan`
hands the three lists to the runner once per step.

The manager never touches tensors and never imports the model.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.config import ALLOCATION_POLICIES, ConfigError
from pagedkv.kv.block_pool import (
    Block,
    BlockHash,
    BlockPool,
    HostBlockPool,
    HostPool,
    hash_block_tokens,
)
from pagedkv.kv.plan import BlockLoad, BlockSave, OffloadPlan, OffloadTiers


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block data src -> dst (CoW: device->device, swap-out: device->host, swap-in: host->device)."""

    src: int
    dst: int


@dataclass(slots=True)
class KVStats:
    """Pool counters for metrics and the dashboard. `tokens_held` counts each physical slot once."""

    num_blocks: int
    free: int  # free blocks, cached ones included
    cached: int  # free but still findable by prefix lookup
    used: int  # referenced by at least one request
    shared: int  # referenced by more than one request
    tokens_held: int
    token_slots: int  # used * block_size
    token_utilization: float
    usage: float
    prefix_queries: int  # tokens looked up at admission
    prefix_hits: int  # tokens served from the prefix cache
    host_blocks: int
    host_free: int
    num_requests: int
    offload_hits: int = 0  # of prefix_hits, tokens loaded from the offload tiers

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(slots=True, eq=False)
class _Request:
    blocks: list[Block]  # device block table; empty while swapped
    num_tokens: int  # tokens held (cached prefix + allocated)
    num_cached: int  # tokens that came from the prefix cache at admission
    hashes: list[BlockHash]  # chained hashes of the full blocks (prefix caching only)
    # while swapped: per logical block (host block id or None if it held no token, token ids if it
    # was cached)
    swapped: list[tuple[int | None, tuple[int, ...] | None]] | None = None
    num_owned_blocks: int = 0  # table length before the last step's speculative lookahead


class _Admission(NamedTuple):
    prefix: list[Block]  # the still-valid leading run of the offered prefix blocks
    hashes: list[BlockHash]  # their chained hashes
    offloaded: list[
        tuple[BlockHash, tuple[int, ...]]
    ]  # the blocks after them found in the offload tier
    num_tokens: int  # tokens held once admitted
    num_new_blocks: int  # blocks to take from the free queue
    fits: bool  # room for them, the revived prefix blocks and the watermark


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables for every request, on one device pool and one host (swap) pool.

    With `offload`, evicted cached blocks (and, with a disk tier, newly full ones) are planned
    into its tiers and prefix hits come back from them; if it has a host tier, that tier is also
    the swap space (pass no num_host_blocks then).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        enable_prefix_caching: bool = True,
        allocation_policy: str = "paged",
        max_model_len: int | None = None,
        watermark: float = 0.01,
        hash_extra: bytes = b"",
        on_evict: Callable[[int, BlockHash], None] | None = None,
        offload: OffloadTiers | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache has room for {num_blocks} blocks; give it more memory (--kv-cache-memory)"
            )
        if block_size < 1:
            raise ConfigError(f"--block-size must be a positive integer, got {block_size}")
        if allocation_policy not in ALLOCATION_POLICIES:
            raise ConfigError(
                f"--allocation-policy must be one of {', '.join(ALLOCATION_POLICIES)}"
            )
        if allocation_policy == "reserve-max" and not max_model_len:
            raise ConfigError("--allocation-policy reserve-max needs --max-model-len")
        if not 0.0 <= watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark}")
        if num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        host: HostPool = HostBlockPool(num_host_blocks)
        if offload is not None and offload.host is not None:
            if num_host_blocks:
                raise ConfigError(
                    "swap space and an offload host tier are one pool: give num_host_blocks=0"
                )
            host = offload.host
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = host.num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.allocation_policy = allocation_policy
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * num_blocks)
        self.hash_extra = hash_extra
        self.pool = BlockPool(num_blocks, self._evicted)
        self.host = host
        self.offload = offload
        self._on_evict = on_evict
        self._saves: list[BlockSave] = []
        self._loads: list[BlockLoad] = []
        self._writes: list[BlockSave] = []
        self._write_through = (
            offload is not None and offload.writes_through and enable_prefix_caching
        )
        self._requests: dict[str, _Request] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.offload_hits = 0

    # ---- prefix cache -------------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest run of cached full blocks matching token_ids, never covering the
        last token (at least one token is always computed). Pure: changes nothing, counts nothing."""
        return [block.block_id for block in self._match_prefix(token_ids, len(token_ids))[0]]

    def _match_prefix(
        self, token_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[Block], list[BlockHash]]:
        blocks: list[Block] = []
        hashes: list[BlockHash] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        bs, extra, get = self.block_size, self.hash_extra, self.pool.get_cached_block
        parent = None
        for i in range(min(max_blocks, (len(token_ids) - 1) // bs)):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, chunk, extra)
            block = get(parent, chunk)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def lookup_offloaded(self, token_ids: Sequence[int], num_prefix_blocks: int) -> int:
        """How many blocks after the first num_prefix_blocks (from lookup_prefix) continue the chain in the
        offload tier, never covering the last token. Pure; 0 without an offload tier."""
        if self.offload is None or not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        parent = None
        for i in range(num_prefix_blocks):
            parent = hash_block_tokens(
                parent, tuple(token_ids[i * bs : (i + 1) * bs]), self.hash_extra
            )
        return len(self._match_offloaded(token_ids, num_prefix_blocks, parent, len(token_ids)))

    def _match_offloaded(
        self, token_ids: Sequence[int], start: int, parent: BlockHash | None, max_blocks: int
    ) -> list[tuple[BlockHash, tuple[int, ...]]]:
        """The blocks from index `start` on whose chained hash (and tokens) the offload tier holds."""
        found: list[tuple[BlockHash, tuple[int, ...]]] = []
        if self.offload is None or not self.enable_prefix_caching:
            return found
        bs = self.block_size
        for i in range(start, min(start + max_blocks, (len(token_ids) - 1) // bs)):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, chunk, self.hash_extra)
            if not self.offload.contains(parent, chunk):
                break
            found.append((parent, chunk))
        return found

    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        if self.offload is not None:
            token_ids = self.pool.blocks[block_id].token_ids
            assert token_ids is not None  # set with the hash; the pool clears both after this call
            self._saves.append(BlockSave(block_id, block_hash, token_ids))
        if self._on_evict is not None:
            self._on_evict(block_id, block_hash)

    def take_offload_plan(self) -> OffloadPlan:
        """This step's saves (evicted cached blocks), loads (tier prefix hits) and writes (blocks
        that became full), handed over once."""
        plan = OffloadPlan(self._saves, self._loads, self._writes)
        self._saves, self._loads, self._writes = [], [], []
        return plan

    def _cache_full_blocks(self, req: _Request, token_ids: Sequence[int]) -> None:
        """Hash and register every block of req that became full since the last call."""
        bs, hashes = self.block_size, req.hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), req.num_tokens // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, chunk, self.hash_extra)
            hashes.append(parent)
            self.pool.cache_full_block(req.blocks[i], parent, chunk)
            if self._write_through:
                self._writes.append(BlockSave(req.blocks[i].block_id, parent, chunk))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any request holds device blocks."""
        return self.pool.reset_prefix_cache()

    # ---- allocation ---------------------------------------------------------------------------

    def _reservation(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Tokens a reservation policy takes at admission (0 under paging)."""
        if self.allocation_policy == "reserve-max":
            return self.max_model_len or 0  # set: __init__ refuses reserve-max without it
        if self.allocation_policy == "reserve-output":
            if max_tokens is None:
                return self.max_model_len or 0
            target = num_prompt_tokens + max_tokens
            return min(target, self.max_model_len) if self.max_model_len else target
        return 0

    def _admission_plan(
        self,
        token_ids: Sequence[int],
        num_new_tokens: int,
        prefix_blocks: Sequence[int],
        max_tokens: int | None,
        num_offloaded: int,
    ) -> _Admission:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks, hashes = self._match_prefix(token_ids, len(prefix_blocks))
        k = 0
        while k < len(blocks) and blocks[k].block_id == prefix_blocks[k]:
            k += 1
        del blocks[k:], hashes[k:]
        offloaded = []
        if num_offloaded and k == len(prefix_blocks):
            offloaded = self._match_offloaded(
                token_ids, k, hashes[-1] if hashes else None, num_offloaded
            )
        held = (k + len(offloaded)) * self.block_size + num_new_tokens
        if held > len(token_ids):
            raise ValueError(f"{held} tokens to hold but only {len(token_ids)} token ids given")
        total = _cdiv(max(held, self._reservation(len(token_ids), max_tokens)), self.block_size)
        num_new = total - k
        revived = sum(1 for block in blocks if block.ref_count == 0)
        fits = num_new + revived + self.watermark_blocks <= self.pool.num_free
        return _Admission(blocks, hashes, offloaded, held, num_new, fits)

    def can_allocate(
        self,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        prefix_blocks: Sequence[int] = (),
        num_offloaded: int = 0,
        max_tokens: int | None = None,
    ) -> bool:
        """Would admitting this request succeed now (watermark included)? Changes nothing."""
        return self._admission_plan(
            token_ids, num_new_tokens, prefix_blocks, max_tokens, num_offloaded
        ).fits

    def allocate_slots(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        prefix_blocks: Sequence[int] = (),
        num_offloaded: int = 0,
        max_tokens: int | None = None,
        num_lookahead: int = 0,
    ) -> list[BlockCopy] | None:
        """Make room for `num_new_tokens` more tokens of req_id; token_ids are all its tokens known so far.

        The first call admits the request: it takes the still-valid leading run of prefix_blocks (from
        lookup_prefix), then of the num_offloaded tier blocks after them (from lookup_offloaded; each
        gets a fresh device block and a BlockLoad), as computed tokens (num_new_tokens then counts from
        their end; read num_cached_tokens after: a tier block whose data fails its check is computed
        instead), keeps the watermark free, counts the prefix query and hits, and under
        a reservation policy takes its whole reservation. Later calls append; a write into a block shared
        after a fork gets a private copy, reported as BlockCopy(shared, private). Blocks that are now
        full are registered in the prefix cache. Returns None and changes nothing when the pool (after
        evicting cached free blocks, LRU first) is too small.

        `num_lookahead` more slots (speculative drafts) are made writable past those tokens but not held:
        no draft is ever hashed; `accept_lookahead` keeps the verified ones and frees the rest.
        """
        req = self._requests.get(req_id)
        if req is None:
            return self._admit(
                req_id, token_ids, num_new_tokens, prefix_blocks, max_tokens, num_offloaded
            )
        if req.swapped is not None:
            raise ValueError(f"request {req_id!r} is swapped out; swap_in first")
        return self._append(req, token_ids, num_new_tokens, num_lookahead)

    def accept_lookahead(self, req_id: str, token_ids: Sequence[int], num_accepted: int) -> None:
        """After a speculative step: hold `num_accepted` more tokens (verified drafts, now in token_ids),
        hash the blocks they fill, and give back every block past them (it holds only rejected drafts)."""
        req = self._running(req_id)
        req.num_tokens += num_accepted
        if req.num_tokens > len(token_ids):
            raise ValueError(
                f"{req.num_tokens} tokens held but only {len(token_ids)} token ids given"
            )
        keep = max(_cdiv(req.num_tokens, self.block_size), req.num_owned_blocks)
        if len(req.blocks) > keep:
            self.pool.free_blocks(reversed(req.blocks[keep:]))
            del req.blocks[keep:]
        if self.enable_prefix_caching and req.num_tokens // self.block_size > len(req.hashes):
            self._cache_full_blocks(req, token_ids)

    def _admit(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        prefix_blocks: Sequence[int],
        max_tokens: int | None,
        num_offloaded: int,
    ) -> list[BlockCopy] | None:
        plan = self._admission_plan(
            token_ids, num_new_tokens, prefix_blocks, max_tokens, num_offloaded
        )
        if not plan.fits:
            return None
        if plan.offloaded:
            assert self.offload is not None  # only offload tiers plan offloaded blocks
            ready = self.offload.reserve(plan.offloaded)
            if ready < len(plan.offloaded):  # fewer tokens held: still fits
                plan = self._admission_plan(
                    token_ids, num_new_tokens, prefix_blocks, max_tokens, ready
                )
        self.pool.touch(plan.prefix)  # before get_new_blocks, which could evict them
        new = self.pool.get_new_blocks(plan.num_new_blocks)
        self._loads += [
            BlockLoad(block_hash, block.block_id)
            for (block_hash, _), block in zip(plan.offloaded, new)
        ]
        num_cached = (len(plan.prefix) + len(plan.offloaded)) * self.block_size
        req = _Request(plan.prefix + new, plan.num_tokens, num_cached, plan.hashes)
        self._requests[req_id] = req
        if self.enable_prefix_caching:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += num_cached
            self.offload_hits += len(plan.offloaded) * self.block_size
            self._cache_full_blocks(req, token_ids)
        return []

    def _append(
        self, req: _Request, token_ids: Sequence[int], num_new_tokens: int, num_lookahead: int = 0
    ) -> list[BlockCopy] | None:
        if num_new_tokens < 0 or num_lookahead < 0:
            raise ValueError(f"token counts must be >= 0, got {num_new_tokens} and {num_lookahead}")
        bs, table, pool = self.block_size, req.blocks, self.pool
        held = req.num_tokens
        target = held + num_new_tokens
        if target > len(token_ids):
            raise ValueError(f"{target} tokens to hold but only {len(token_ids)} token ids given")
        req.num_owned_blocks = max(len(table), _cdiv(target, bs))  # past it: lookahead only
        needed = _cdiv(target + num_lookahead, bs)
        grow = max(0, needed - len(table))
        shared = [i for i in range(held // bs, min(len(table), needed)) if table[i].ref_count > 1]
        if grow + len(shared) > pool.num_free:
            return None
        copies: list[BlockCopy] = []
        if shared:
            old = [table[i] for i in shared]
            for i, new in zip(shared, pool.get_new_blocks(len(shared))):
                if i * bs < held:  # holds tokens: the runner must copy them
                    copies.append(BlockCopy(table[i].block_id, new.block_id))
                table[i] = new
            pool.free_blocks(old)  # still held by the sibling(s)
        if grow:
            table += pool.get_new_blocks(grow)
        req.num_tokens = target
        if self.enable_prefix_caching and target // bs > len(req.hashes):
            self._cache_full_blocks(req, token_ids)
        return copies

    def free(self, req_id: str) -> None:
        """Release a request (finished, aborted or preempted for recompute). Unknown ids are ignored.

        Blocks go back tail first, so the least shared blocks are evicted first."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return
        if req.swapped is not None:
            self.host.release(host for host, _ in req.swapped if host is not None)
        else:
            self.pool.free_blocks(reversed(req.blocks))

    def uncache_uncomputed(self, req_id: str, num_computed_tokens: int) -> None:
        """Before freeing a request whose step failed: its blocks from token num_computed_tokens on
        were registered at allocation but may be half written, so they leave the prefix cache (and
        never reach an offload tier), unless another request still holds (and computes) them."""
        req = self._requests.get(req_id)
        if req is None or req.swapped is not None:
            return
        for block in req.blocks[num_computed_tokens // self.block_size :]:
            if block.ref_count == 1:
                self.pool.uncache(block)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child shares every block of parent (ref++) and has the same token count."""
        parent = self._running(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        self.pool.touch(parent.blocks)
        self._requests[child_id] = _Request(
            list(parent.blocks), parent.num_tokens, parent.num_cached, list(parent.hashes)
        )

    # ---- swap ---------------------------------------------------------------------------------

    def can_swap_out(self, req_id: str) -> bool:
        req = self._requests.get(req_id)
        return (
            req is not None
            and req.swapped is None
            and _cdiv(req.num_tokens, self.block_size) <= self.host.num_free()
        )

    def swap_out(self, req_id: str) -> list[BlockCopy] | None:
        """Plan device->host copies of the blocks holding tokens and free the device blocks (cached ones
        stay findable). None, and no change, if the host pool is too small."""
        req = self._running(req_id)
        filled = _cdiv(req.num_tokens, self.block_size)
        if filled > self.host.num_free():
            return None
        hosts = iter(self.host.take(filled))
        copies: list[BlockCopy] = []
        swapped: list[tuple[int | None, tuple[int, ...] | None]] = []
        for i, block in enumerate(req.blocks):
            if i < filled:
                host = next(hosts)
                copies.append(BlockCopy(block.block_id, host))
                swapped.append((host, block.token_ids))
            else:
                swapped.append((None, None))  # reserved, empty: nothing to keep
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks = []
        req.swapped = swapped
        return copies

    def swap_in(self, req_id: str) -> list[BlockCopy] | None:
        """Plan host->device copies back. Logical blocks whose content is still cached on the device
        are reused instead of copied. None, and no change, if the device pool is too small."""
        req = self._requests.get(req_id)
        if req is None or req.swapped is None:
            raise ValueError(f"request {req_id!r} is not swapped out")
        reuse: list[Block | None] = []
        for i, (_, token_ids) in enumerate(req.swapped):
            hit = (
                self.pool.get_cached_block(req.hashes[i], token_ids)
                if token_ids is not None
                else None
            )
            reuse.append(hit)
        num_fresh = reuse.count(None)
        revived = sum(1 for block in reuse if block is not None and block.ref_count == 0)
        if num_fresh + revived > self.pool.num_free:
            return None
        self.pool.touch(block for block in reuse if block is not None)
        fresh = iter(self.pool.get_new_blocks(num_fresh))
        copies: list[BlockCopy] = []
        table: list[Block] = []
        for (host, token_ids), block in zip(req.swapped, reuse):
            if block is None:
                block = next(fresh)
                if host is not None:
                    copies.append(BlockCopy(host, block.block_id))
                if token_ids is not None:
                    self.pool.cache_full_block(block, req.hashes[len(table)], token_ids)
            table.append(block)
        self.host.release(host for host, _ in req.swapped if host is not None)
        req.blocks = table
        req.swapped = None
        return copies

    def is_swapped(self, req_id: str) -> bool:
        return self._get(req_id).swapped is not None

    # ---- queries ------------------------------------------------------------------------------

    def _get(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        return req

    def _running(self, req_id: str) -> _Request:
        req = self._get(req_id)
        if req.swapped is not None:
            raise ValueError(f"request {req_id!r} is swapped out")
        return req

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def num_computed_tokens(self, req_id: str) -> int:
        return self._get(req_id).num_tokens

    def num_cached_tokens(self, req_id: str) -> int:
        return self._get(req_id).num_cached

    def block_table(self, req_id: str) -> list[int]:
        """Physical block ids by logical index (empty while swapped)."""
        return [block.block_id for block in self._get(req_id).blocks]

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        """Fraction of device blocks referenced by some request."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of num_tokens (prompt + max_tokens) ever be admitted into the empty pool?"""
        tokens = num_tokens
        if self.allocation_policy == "reserve-max":
            tokens = max(num_tokens, self.max_model_len or 0)
        return _cdiv(tokens, self.block_size) + self.watermark_blocks <= self.num_blocks

    def _block_fills(self) -> tuple[dict[int, int], dict[int, list[str]]]:
        """Tokens in each referenced block, and who holds it. O(total table length)."""
        fills: dict[int, int] = {}
        owners: dict[int, list[str]] = defaultdict(list)
        bs = self.block_size
        for req_id, req in self._requests.items():
            for i, block in enumerate(req.blocks):
                fill = min(bs, max(0, req.num_tokens - i * bs))
                fills[block.block_id] = max(fill, fills.get(block.block_id, 0))
                owners[block.block_id].append(req_id)
        return fills, owners

    def stats(self) -> KVStats:
        """Counters for /metrics and the dashboard. O(blocks + table entries): per scrape, not per step."""
        free = self.pool.num_free
        used = self.num_blocks - free
        tokens_held = sum(self._block_fills()[0].values())
        token_slots = used * self.block_size
        return KVStats(
            num_blocks=self.num_blocks,
            free=free,
            cached=sum(1 for block in self.pool.cached.values() if block.ref_count == 0),
            used=used,
            shared=sum(1 for block in self.pool.blocks if block.ref_count > 1),
            tokens_held=tokens_held,
            token_slots=token_slots,
            token_utilization=tokens_held / token_slots if token_slots else 0.0,
            usage=used / self.num_blocks,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            host_blocks=self.num_host_blocks,
            host_free=self.host.num_free(),
            num_requests=len(self._requests),
            offload_hits=self.offload_hits,
        )

    def snapshot(self) -> dict:
        """JSON-able view for GET /v1/kv and the dashboard: stats, every block, every request."""
        stats = self.stats()
        fills, owners = self._block_fills()
        blocks = []
        for block in self.pool.blocks:
            bid = block.block_id
            state = (
                "used"
                if block.ref_count
                else ("cached" if block.block_hash is not None else "free")
            )
            fill = fills.get(bid, self.block_size if state == "cached" else 0)
            blocks.append(
                {
                    "id": bid,
                    "state": state,
                    "ref_count": block.ref_count,
                    "fill": fill,
                    "owners": owners.get(bid, []),
                }
            )
        requests = {
            req_id: {
                "block_table": [block.block_id for block in req.blocks],
                "num_tokens": req.num_tokens,
                "num_cached_tokens": req.num_cached,
                "swapped": req.swapped is not None,
            }
            for req_id, req in self._requests.items()
        }
        return {
            **dataclasses.asdict(stats),
            "prefix_hit_rate": stats.prefix_hit_rate,
            "block_size": self.block_size,
            "allocation_policy": self.allocation_policy,
            "prefix_caching": self.enable_prefix_caching,
            "blocks": blocks,
            "requests": requests,
        }

    def check_integrity(self) -> None:
        """Pool audit, plus: each ref count equals the number of tables holding the block, tables are
        long enough, hashes agree with the tables, and no host block is lost or held twice."""
        self.pool.check_integrity()
        bs = self.block_size
        refs: Counter[int] = Counter()
        hosts: list[int] = []
        for req_id, req in self._requests.items():
            want = req.num_tokens // bs if self.enable_prefix_caching else 0
            assert len(req.hashes) == want, (
                f"{req_id}: {len(req.hashes)} hashes for {want} full blocks"
            )
            if req.swapped is not None:
                assert not req.blocks, f"{req_id}: swapped but holds device blocks"
                assert len(req.swapped) >= _cdiv(req.num_tokens, bs), (
                    f"{req_id}: swapped table too short"
                )
                hosts += [host for host, _ in req.swapped if host is not None]
                continue
            assert len(req.blocks) >= _cdiv(req.num_tokens, bs), (
                f"{req_id}: table too short for its tokens"
            )
            assert len({block.block_id for block in req.blocks}) == len(req.blocks), (
                f"{req_id}: block twice"
            )
            for i, block in enumerate(req.blocks):
                refs[block.block_id] += 1
                if block.block_hash is not None:
                    assert i < len(req.hashes) and req.hashes[i] == block.block_hash, (
                        f"{req_id}: block {block.block_id} at {i} has a foreign hash"
                    )
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held by {refs[block.block_id]} tables"
            )
        self.host.check_integrity(hosts)

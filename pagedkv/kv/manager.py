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

Each sequence brings its `BlockHashes` (from `block_hashes`, extended by the
sequence as its tokens arrive), so no token is hashed twice.

With offload tiers (`pagedkv.kv.plan.OffloadTiers`), a cached block the pool
evicts becomes a BlockSave (saved before anything overwrites it), admission
continues the prefix match in the tiers (hits load into fresh blocks: BlockLoad),
and with a disk tier every block that becomes full is written through after the
step's forward. `take_offload_plan` hands the lists to the runner once per step.

The manager never touches tensors and never imports the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.kv import report, swap
from pagedkv.kv.block_pool import Block, BlockPool
from pagedkv.kv.hashing import BlockHash, BlockHashes
from pagedkv.kv.plan import BlockCopy, BlockLoad, BlockSave, OffloadPlan, OffloadTiers
from pagedkv.kv.policy import Admission, AllocationPolicy
from pagedkv.kv.prefix import NO_PREFIX, PrefixMatch, cached_run, match_prefix, tier_run
from pagedkv.kv.report import KVStats
from pagedkv.kv.table import RequestBlocks, cdiv


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
        self.policy = AllocationPolicy.checked(
            allocation_policy, num_blocks, block_size, max_model_len, watermark
        )
        host = swap.host_pool(num_host_blocks, offload)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = host.num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.allocation_policy = allocation_policy
        self.max_model_len = max_model_len
        self.watermark_blocks = self.policy.watermark_blocks
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
        self.requests: dict[str, RequestBlocks] = {}  # read by `report`; changed only here
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.offload_hits = 0

    # ---- prefix cache -------------------------------------------------------------------------

    def block_hashes(
        self,
        token_ids: Sequence[int],
        num_tokens: int | None = None,
        salt: str | None = None,
        adapter: str | None = None,
    ) -> BlockHashes:
        """A new sequence's block hashes over token_ids[:num_tokens], keyed as this pool keys its
        blocks (and by its request's cache salt and LoRA adapter); the sequence extends them as
        its tokens arrive (nothing is hashed with prefix caching off)."""
        block_size = self.block_size if self.enable_prefix_caching else None
        return BlockHashes(block_size, self.hash_extra, token_ids, num_tokens, salt, adapter)

    def lookup_prefix(self, hashes: BlockHashes) -> PrefixMatch:
        """The longest run of cached full blocks matching the sequence, then the blocks after it in
        the offload tiers; never covering its last token (at least one token is always computed).
        Pure: changes nothing, counts nothing."""
        if not self.enable_prefix_caching:
            return NO_PREFIX
        self._check_hashes(hashes)
        return match_prefix(hashes, self.pool, self.offload)

    def _check_hashes(self, hashes: BlockHashes) -> None:
        if self.enable_prefix_caching and (
            hashes.block_size != self.block_size or hashes.extra != self.hash_extra
        ):
            raise ValueError("block hashes made for another pool: use KVCacheManager.block_hashes")

    def _evicted(self, block_id: int, block_hash: BlockHash) -> None:
        # a write-through not yet taken (a block accept_lookahead filled after its forward) would
        # read what the block's next owner writes, under this hash
        self._writes = [w for w in self._writes if w.block_id != block_id]
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

    def _cache_full_blocks(self, req: RequestBlocks, hashes: BlockHashes, start: int) -> None:
        """Register req's blocks from `start` on that its held tokens fill, under the hashes the
        sequence computed as its tokens arrived."""
        keys, chunks = hashes.hashes, hashes.chunks
        for i in range(start, req.num_tokens // self.block_size):
            block = req.blocks[i]
            self.pool.cache_full_block(block, keys[i], chunks[i])
            if self._write_through:
                self._writes.append(BlockSave(block.block_id, keys[i], chunks[i]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any request holds device blocks."""
        if not self.pool.reset_prefix_cache():
            return False
        self._writes = []  # their blocks are no longer what the hashes say once reused
        return True

    # ---- allocation ---------------------------------------------------------------------------

    def _admission_plan(
        self,
        hashes: BlockHashes,
        num_new_tokens: int,
        prefix: PrefixMatch,
        max_tokens: int | None,
    ) -> Admission:
        """Re-check the offered prefix (its blocks may have been evicted since lookup) and size
        the admission."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks: list[Block] = []
        num_offloaded = 0
        if self.enable_prefix_caching and prefix.num_blocks:
            offered = prefix.block_ids
            blocks = cached_run(hashes, self.pool, len(offered))
            k = 0
            while k < len(blocks) and blocks[k].block_id == offered[k]:
                k += 1
            del blocks[k:]
            if k == len(offered):
                num_offloaded = tier_run(hashes, self.offload, k, prefix.num_offloaded)
        return self.policy.admission(
            blocks, num_offloaded, num_new_tokens, hashes.num_tokens, max_tokens, self.pool.num_free
        )

    def can_allocate(
        self,
        hashes: BlockHashes,
        num_new_tokens: int,
        *,
        prefix: PrefixMatch = NO_PREFIX,
        max_tokens: int | None = None,
    ) -> bool:
        """Would admitting this request succeed now (watermark included)? Changes nothing."""
        self._check_hashes(hashes)
        return self._admission_plan(hashes, num_new_tokens, prefix, max_tokens).fits

    def allocate_slots(
        self,
        req_id: str,
        hashes: BlockHashes,
        num_new_tokens: int,
        *,
        prefix: PrefixMatch = NO_PREFIX,
        max_tokens: int | None = None,
        num_lookahead: int = 0,
    ) -> list[BlockCopy] | None:
        """Make room for `num_new_tokens` more of req_id's tokens (`hashes`: its sequence's).

        The first call admits: it takes the still-valid run of `prefix` (from lookup_prefix) as
        computed tokens, tier blocks loaded into fresh blocks (BlockLoad; read num_cached_tokens
        after: a tier block that fails its check is computed instead), keeps the watermark free,
        counts the prefix query and hits, and takes a reservation policy's whole reservation.
        Later calls append; a write into a block shared after a fork gets a private copy,
        BlockCopy(shared, private). Blocks now full enter the prefix cache. None, and no change,
        when the pool (after evicting cached free blocks, LRU first) is too small.

        `num_lookahead` more slots (speculative drafts) are made writable but not held: no draft
        is ever hashed; `accept_lookahead` keeps the verified ones and frees the rest.
        """
        self._check_hashes(hashes)
        req = self.requests.get(req_id)
        if req is None:
            return self._admit(req_id, hashes, num_new_tokens, prefix, max_tokens)
        if req.swapped is not None:
            raise ValueError(f"request {req_id!r} is swapped out; swap_in first")
        return self._append(req, hashes, num_new_tokens, num_lookahead)

    def accept_lookahead(self, req_id: str, hashes: BlockHashes, num_accepted: int) -> None:
        """After a speculative step: hold `num_accepted` more tokens (verified drafts, now in the
        sequence), register the blocks they fill, and give back every block past them (it holds
        only rejected drafts)."""
        req = self._running(req_id)
        held, target = req.num_tokens, req.num_tokens + num_accepted
        if target > hashes.num_tokens:
            raise ValueError(f"{target} tokens held but only {hashes.num_tokens} token ids given")
        req.num_tokens = target
        keep = max(cdiv(target, self.block_size), req.num_owned_blocks)
        if len(req.blocks) > keep:
            self.pool.free_blocks(reversed(req.blocks[keep:]))
            del req.blocks[keep:]
        if self.enable_prefix_caching and target // self.block_size > held // self.block_size:
            self._cache_full_blocks(req, hashes, held // self.block_size)

    def _admit(
        self,
        req_id: str,
        hashes: BlockHashes,
        num_new_tokens: int,
        prefix: PrefixMatch,
        max_tokens: int | None,
    ) -> list[BlockCopy] | None:
        plan = self._admission_plan(hashes, num_new_tokens, prefix, max_tokens)
        if not plan.fits:
            return None
        k, end = len(plan.prefix), len(plan.prefix) + plan.num_offloaded
        loads = list(zip(hashes.hashes[k:end], hashes.chunks[k:end])) if end > k else []
        if loads:
            assert self.offload is not None  # only offload tiers plan offloaded blocks
            ready = self.offload.reserve(loads)
            if ready < len(loads):  # a tier block failed its check: fewer tokens held, still fits
                free = self.pool.num_free
                plan = self.policy.admission(
                    plan.prefix, ready, num_new_tokens, hashes.num_tokens, max_tokens, free
                )
        self.pool.touch(plan.prefix)  # before get_new_blocks, which could evict them
        new = self.pool.get_new_blocks(plan.num_new_blocks)
        self._loads += [
            BlockLoad(block_hash, block.block_id)
            for (block_hash, _), block in zip(loads[: plan.num_offloaded], new)
        ]
        num_cached = (k + plan.num_offloaded) * self.block_size
        req = RequestBlocks(plan.prefix + new, plan.num_tokens, num_cached)
        self.requests[req_id] = req
        if self.enable_prefix_caching:
            self.prefix_queries += hashes.num_tokens
            self.prefix_hits += num_cached
            self.offload_hits += plan.num_offloaded * self.block_size
            if plan.num_tokens // self.block_size > k:
                self._cache_full_blocks(req, hashes, k)
        return []

    def _append(
        self, req: RequestBlocks, hashes: BlockHashes, num_new_tokens: int, num_lookahead: int
    ) -> list[BlockCopy] | None:
        if num_new_tokens < 0 or num_lookahead < 0:
            raise ValueError(f"token counts must be >= 0, got {num_new_tokens} and {num_lookahead}")
        bs, table, pool = self.block_size, req.blocks, self.pool
        held = req.num_tokens
        target = held + num_new_tokens
        if target > hashes.num_tokens:
            raise ValueError(
                f"{target} tokens to hold but only {hashes.num_tokens} token ids given"
            )
        req.num_owned_blocks = max(len(table), cdiv(target, bs))  # past it: lookahead only
        needed = cdiv(target + num_lookahead, bs)
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
        if self.enable_prefix_caching and target // bs > held // bs:
            self._cache_full_blocks(req, hashes, held // bs)
        return copies

    def free(self, req_id: str) -> None:
        """Release a request (finished, aborted or preempted for recompute). Unknown ids are
        ignored. Blocks go back tail first, so the least shared blocks are evicted first."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if req.swapped is not None:
            self.host.release(b.host for b in req.swapped if b.host is not None)
        else:
            self.pool.free_blocks(reversed(req.blocks))

    def uncache_uncomputed(self, req_id: str, num_computed_tokens: int) -> None:
        """Before freeing a request whose step failed: its blocks from token num_computed_tokens on
        were registered at allocation but may be half written, so they leave the prefix cache (and
        never reach an offload tier), unless another request still holds (and computes) them."""
        req = self.requests.get(req_id)
        if req is None or req.swapped is not None:
            return
        for block in req.blocks[num_computed_tokens // self.block_size :]:
            if block.ref_count == 1:
                self.pool.uncache(block)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child shares every block of parent (ref++) and has the same token count."""
        parent = self._running(parent_id)
        if child_id in self.requests:
            raise ValueError(f"request {child_id!r} already exists")
        self.pool.touch(parent.blocks)
        self.requests[child_id] = RequestBlocks(
            list(parent.blocks), parent.num_tokens, parent.num_cached
        )

    # ---- swap (`pagedkv.kv.swap`) -------------------------------------------------------------

    def can_swap_out(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        return req is not None and swap.fits_host(req, self.host, self.block_size)

    def swap_out(self, req_id: str) -> list[BlockCopy] | None:
        """Plan device->host copies of the blocks holding tokens and free the device blocks (cached
        ones stay findable). None, and no change, if the host pool is too small."""
        return swap.swap_out(self._running(req_id), self.pool, self.host, self.block_size)

    def swap_in(self, req_id: str) -> list[BlockCopy] | None:
        """Plan host->device copies back, reusing blocks still cached on the device. None, and no
        change, if the device pool is too small."""
        req = self.requests.get(req_id)
        if req is None or req.swapped is None:
            raise ValueError(f"request {req_id!r} is not swapped out")
        return swap.swap_in(req, self.pool, self.host)

    def is_swapped(self, req_id: str) -> bool:
        return self._get(req_id).swapped is not None

    # ---- queries ------------------------------------------------------------------------------

    def _get(self, req_id: str) -> RequestBlocks:
        req = self.requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request {req_id!r}")
        return req

    def _running(self, req_id: str) -> RequestBlocks:
        req = self._get(req_id)
        if req.swapped is not None:
            raise ValueError(f"request {req_id!r} is swapped out")
        return req

    def has_request(self, req_id: str) -> bool:
        return req_id in self.requests

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
        """Could a request of num_tokens (prompt + max_tokens) ever be admitted into the empty
        pool?"""
        return self.policy.can_fit(num_tokens)

    def stats(self) -> KVStats:
        """Counters for /metrics and the dashboard. O(blocks + table entries): per scrape."""
        return report.kv_stats(self)

    def snapshot(self) -> dict:
        """JSON-able view for GET /v1/kv and the dashboard: stats, every block, every request."""
        return report.kv_snapshot(self)

    def check_integrity(self) -> None:
        """The full audit (`pagedkv.kv.report.check_integrity`); tests run it after every call."""
        report.check_integrity(self)

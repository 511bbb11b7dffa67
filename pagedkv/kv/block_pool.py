"""Physical KV blocks: ref counts, an O(1) LRU free queue, and the prefix-cache map.

The pool is pure mechanism: it hands out block ids and remembers which full
blocks hold which (hashed) tokens. It knows nothing of requests; the manager
builds block tables on top of it.

    free queue (LRU order, evict from the head, freed blocks go to the tail)

    HEAD <-> [7 cached] <-> [2] <-> [9 cached] <-> [4] <-> TAIL
              ^ evicted first                        ^ freed last

A freed block keeps its hash and stays findable through `cached` until
`get_new_blocks` pops it for reuse. A cache hit on a free block takes it out
of the middle of the queue in O(1) (`touch`), because each block carries its
own prev/next pointers: no scan, no allocation on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.kv.hashing import BlockHash, TokenIds


@dataclass(slots=True, eq=False)
class Block:
    """One physical block. `token_ids` is set only while the block is in the prefix cache."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: TokenIds | None = None
    prev: Block | None = None
    next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks between sentinel head and tail.

    A block is in the queue exactly when its `prev` is not None.
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self.head = Block(-1)
        self.tail = Block(-2)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self.head.next
        if block is self.tail or block is None:
            raise IndexError("free queue is empty")
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        last = self.tail.prev
        assert last is not None  # the head sentinel at least
        last.next = block
        block.prev = last
        block.next = self.tail
        self.tail.prev = block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[Block]:
        block = self.head.next
        while block is not self.tail and block is not None:
            yield block
            block = block.next

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """`num_blocks` physical blocks, their ref counts, the free queue and the hash -> block map.

    `on_evict(block_id, block_hash)` is called when a cached free block is
    about to be reused, so an offload tier can save its contents first.
    """

    def __init__(
        self, num_blocks: int, on_evict: Callable[[int, BlockHash], None] | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (they are evictable)."""
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop `n` blocks from the LRU head (ref 1 each), evicting their cached hashes."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block; a free cached block leaves the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching 0 go to the tail in the given order, hash
        kept."""
        for block in ordered:
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash, token_ids: TokenIds) -> Block | None:
        """The cached block for this hash, only if it really holds these tokens."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_full_block(self, block: Block, block_hash: BlockHash, token_ids: TokenIds) -> None:
        """Make a full, referenced block findable. A second block with the same content stays
        unhashed."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block

    def uncache(self, block: Block) -> None:
        """Make a block unfindable without saving it anywhere: its data cannot be trusted."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is referenced."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        return True

    def _evict(self, block: Block) -> None:
        assert block.block_hash is not None  # only cached blocks are evicted
        if self.on_evict is not None:
            self.on_evict(block.block_id, block.block_hash)
        del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def check_integrity(self) -> None:
        """Audit: free xor referenced, no duplicates, counts add up, map and hashes agree."""
        seen: set[int] = set()
        prev = self.free_queue.head
        for block in self.free_queue:
            assert block.block_id not in seen, f"block {block.block_id} twice in the free queue"
            assert block.prev is prev, f"broken back link at block {block.block_id}"
            assert block.ref_count == 0, (
                f"free block {block.block_id} has ref_count {block.ref_count}"
            )
            seen.add(block.block_id)
            prev = block
        assert self.free_queue.tail.prev is prev, "broken tail link"
        assert len(seen) == self.free_queue.num_free, (
            f"queue holds {len(seen)}, counter says {self.free_queue.num_free}"
        )
        used = 0
        for block in self.blocks:
            if block.block_id in seen:
                continue
            assert block.prev is None and block.next is None, (
                f"block {block.block_id} linked but not in queue"
            )
            assert block.ref_count > 0, f"block {block.block_id} neither free nor referenced"
            used += 1
        assert len(seen) + used == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, (
                f"map entry points to block {block.block_id} with another hash"
            )
            assert block.token_ids is not None, f"cached block {block.block_id} has no token ids"
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"block {block.block_id} hashed but not findable"
                )
            else:
                assert block.token_ids is None, f"unhashed block {block.block_id} keeps token ids"


class HostPool(Protocol):
    """Where swapped-out blocks go: host block ids the manager takes and gives back.

    `HostBlockPool` is plain swap space; the offload host tier
    (`pagedkv.kvstore.offload.HostTier`) is the other kind: it lends its slots to swap and evicts
    cached blocks to make room.
    """

    num_slots: int

    def num_free(self) -> int:
        """Slots `take` can hand out now."""
        ...

    def take(self, n: int) -> list[int]: ...

    def release(self, slots: Iterable[int]) -> None: ...

    def check_integrity(self, held: Sequence[int]) -> None:
        """Audit, given the slots that swapped requests hold."""
        ...


class HostBlockPool:
    """Swap space: a free list of host block ids, handed out lowest first, reused last-in
    first-out."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first

    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"asked for {n} host blocks, only {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: Iterable[int]) -> None:
        self._free.extend(slots)

    def check_integrity(self, held: Sequence[int]) -> None:
        assert sorted([*self._free, *held]) == list(range(self.num_slots)), (
            "host blocks lost or held twice"
        )

"""The KV offload tiers under tensor parallelism: rank 0 decides, every rank moves its own heads.

Every rank has its own host tier (the same number of slots) and its own disk
folder (its key names the rank and the TP size, so no other rank and no other TP
size reads those files). Rank 0's block manager plans for all of them, and every
rank makes the same calls on its own tiers, so each host tier holds the same
block in the same slot:

    rank 0 (scheduling)                              the other ranks, in the same order
    manager takes / releases host slots for swap --> logged; replayed before the next message
    admission reserves prefix blocks in the tiers --> TierReserve: the same reservation
    runner: block moves with the step's saves and loads, then the forward's write-throughs
                                                 --> BlockMoves, DiskWrites (engine/runner.py)

What touches only a rank's own disk (whether a block still needs writing, a
write dropped by a full queue) is that rank's business. What all must agree on
is a load: each rank reads and checks its own files, and all take the shortest
readable run (an all-reduce), so a missing or bad file on any rank makes the
block a miss on every rank, recomputed, never mixed K/V.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.distributed.group import TensorParallelGroup, min_over_ranks
from pagedkv.kv.block_pool import BlockHash
from pagedkv.kv.plan import TokenIds
from pagedkv.kvstore.offload import HostTier, KVOffload

HostOp = tuple[str, int | list[int]]  # ("take", n) or ("release", slots)


class LoggedHost:
    """Rank 0's host tier as its manager sees it (a HostPool): slots taken and released for swap
    are logged, for the other ranks to replay on their copies."""

    def __init__(self, host: HostTier, log: list[HostOp]) -> None:
        self.host, self.log = host, log
        self.num_slots = host.num_slots

    def num_free(self) -> int:
        return self.host.num_free()

    def take(self, n: int) -> list[int]:
        slots = self.host.take(n)
        self.log.append(("take", n))
        return slots

    def release(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        self.host.release(slots)
        self.log.append(("release", slots))

    def check_integrity(self, held: Sequence[int]) -> None:
        self.host.check_integrity(held)


def replay(offload: KVOffload | None, ops: list[HostOp]) -> None:
    """Make a rank's host tier take and release what rank 0's did, in the same order."""
    host = offload.host if offload is not None else None
    assert host is not None  # only a host tier logs
    for op, arg in ops:
        if op == "take":
            assert isinstance(arg, int)
            host.take(arg)
        else:
            assert isinstance(arg, list)
            host.release(arg)


@dataclass
class TierReserve:
    """A reservation of prefix blocks, made on every rank and agreed by all."""

    blocks: list[tuple[BlockHash, TokenIds]]

    def apply(self, offload: KVOffload | None) -> None:
        assert offload is not None  # only tiers reserve
        offload.reserve(self.blocks, min_over_ranks)


class TensorParallelTiers:
    """Rank 0's tiers as its block manager sees them (`OffloadTiers`): the same answers, with the
    host tier's slot changes logged and each reservation sent to the ranks and agreed by all."""

    def __init__(self, offload: KVOffload, group: TensorParallelGroup) -> None:
        self.offload, self.group = offload, group
        self.host = None if offload.host is None else LoggedHost(offload.host, group.host_ops)
        self.writes_through = offload.writes_through

    def contains(self, block_hash: BlockHash, token_ids: TokenIds) -> bool:
        return self.offload.contains(block_hash, token_ids)

    def reserve(self, blocks: Sequence[tuple[BlockHash, TokenIds]]) -> int:
        self.group.send(TierReserve(list(blocks)))
        return self.offload.reserve(blocks, self.group.min_over_ranks)

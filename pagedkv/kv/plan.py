"""What the KV manager plans each step (block copies, tier saves and loads), and what it asks of
the offload tiers.

A leaf module: the manager (which plans) and the runner and tiers (which move
tensors, `pagedkv.kvstore`) both import it, and neither side imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pagedkv.kv.block_pool import HostPool
from pagedkv.kv.hashing import BlockHash, TokenIds


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy block data src -> dst (CoW: device->device, swap-out: device->host, swap-in:
    host->device)."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class BlockSave:
    """A full, hashed device block whose data goes to the offload tiers: evicted this step (saved
    before anything overwrites it) or, with a disk tier, just filled (written through after the
    forward that fills it)."""

    block_id: int
    block_hash: BlockHash
    token_ids: TokenIds


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """A prefix block found in an offload tier: load it into device block dst before the forward."""

    block_hash: BlockHash
    dst: int


class OffloadPlan(NamedTuple):
    """One step's offload work, handed from the manager to the runner once."""

    saves: list[BlockSave]  # evicted cached blocks: read before the step's block copies
    loads: list[BlockLoad]  # tier prefix hits: written into the device before the forward
    writes: list[BlockSave]  # blocks filled this step: written through after the forward


class OffloadTiers(Protocol):
    """The manager's view of the tiers behind the device pool
    (`pagedkv.kvstore.offload.KVOffload`)."""

    @property
    def host(self) -> HostPool | None:
        """With a host tier, it is also the swap space."""

    @property
    def writes_through(self) -> bool:
        """Wants every block that becomes full (it has a disk tier)."""

    def contains(self, block_hash: BlockHash, token_ids: TokenIds) -> bool: ...

    def reserve(self, blocks: Sequence[tuple[BlockHash, TokenIds]]) -> int:
        """Make the leading run of these blocks loadable this step; returns the run's length."""
        ...

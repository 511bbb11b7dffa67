"""Tiered KV offload: cached prefix blocks evicted from the device live on in host memory, then on
disk.

    device pool --evicted--> host tier (LRU slots) --full--> disk tier (file per block) --> gone
       ^  |                       |                               ^  |
       |  +---- every block once full (written through) ---------+  |
       +-------- prefix hit ------+----------------------------------+

Blocks are keyed by their chained block hash (blake2b over the parent hash,
the token ids, the model fingerprint and the KV dtype), which is stable across
processes, so the disk tier outlives the engine: a new engine on the same model
and KV dtype indexes the folder at start-up and finds what the last one wrote.
Every entry also keeps its token ids, compared on each hit as the device cache
does, so even a hash collision cannot hand out wrong K/V.

With a disk tier, each block is copied to host memory as soon as the forward
has filled it and queued for the disk writer (`pagedkv.kvstore.disk_tier`), so what
is still cached on the device or the host at shutdown is on disk too; a block
already on disk (or queued) is not copied again, and a full queue drops the
write (counted) rather than wait.

One step, as the manager plans it and the runner carries it out:

    scheduling  a cached device block is evicted    -> BlockSave (recorded; nothing moves yet)
                admission continues the prefix match in the tiers -> `reserve`: a host slot is
                pinned, a disk file is read and checked now (a bad one is skipped before its
                tokens count as computed)             -> BlockLoad into a fresh device block
                a block becomes full (with a disk tier) -> BlockSave in the plan's writes
    runner      stage:  reads only: the device blocks to save, the blocks to load, and cached
                        host blocks that swap-out will overwrite (sent to disk here)
                swap out, copy-on-write, swap in      (unchanged)
                commit: writes: the loaded blocks into the device, the saved blocks into the
                        host tier (whose LRU block goes to disk)
                forward, then `write_through`: the blocks it filled are copied and queued for disk

Reading everything first means no write of the step clobbers data the step
still needs: evicted device blocks are read before any device write, and the
host slots that loads and swap-ins read are only overwritten at commit.

The host tier is also the swap space: swap-out takes free slots first, then
the slots of the least recently used cached blocks (which go to disk), so one
budget, `--kv-offload-host-memory`, holds both; live requests come first.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from pagedkv.config import ConfigError, EngineConfig, format_size
from pagedkv.kv.hashing import BlockHash, TokenIds
from pagedkv.kv.plan import BlockLoad, BlockSave
from pagedkv.kvstore.disk_tier import DiskTier
from pagedkv.kvstore.storage import KVStorage

log = logging.getLogger("pagedkv.offload")


# ---- host memory ------------------------------------------------------------------------------


@dataclass(slots=True)
class _HostEntry:
    slot: int
    token_ids: TokenIds


class HostTier:
    """Host-memory block slots: an LRU cache of evicted prefix blocks, whose slots swap can borrow.

    Each slot is free, holds one cached block (`_lru`, least recently used first) or is lent to a
    swapped-out request. Implements the manager's HostPool (num_free / take / release).
    """

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.num_slots = storage.num_blocks
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._lru: OrderedDict[BlockHash, _HostEntry] = OrderedDict()
        self._pinned: set[BlockHash] = set()  # read by a load this step
        self._lent: set[int] = set()
        self.displaced: list[
            tuple[BlockHash, _HostEntry]
        ] = []  # evicted for swap, data not yet moved

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def find(self, block_hash: BlockHash, token_ids: TokenIds) -> int | None:
        """The slot caching exactly these tokens under this hash, or None."""
        entry = self._lru.get(block_hash)
        return entry.slot if entry is not None and entry.token_ids == token_ids else None

    def slot(self, block_hash: BlockHash) -> int:
        return self._lru[block_hash].slot

    def touch(self, block_hash: BlockHash) -> bool:
        """Mark as most recently used; False if not cached."""
        if block_hash not in self._lru:
            return False
        self._lru.move_to_end(block_hash)
        return True

    def pin(self, block_hash: BlockHash) -> None:
        """Keep this block in its slot until `unpin_all` (a load reads it this step)."""
        self.touch(block_hash)
        self._pinned.add(block_hash)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def order(self) -> list[BlockHash]:
        """Cached hashes, least recently used first."""
        return list(self._lru)

    def insert(
        self, block_hash: BlockHash, token_ids: TokenIds
    ) -> tuple[int, tuple[BlockHash, _HostEntry] | None] | None:
        """A slot for a new cached block: a free one, else the LRU block's, returned as the victim
        so the caller can move its data out first. None when every slot is lent or pinned."""
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._evict_lru()
            if victim is None:
                return None
            slot = victim[1].slot
        self._lru[block_hash] = _HostEntry(slot, token_ids)
        return slot, victim

    def _evict_lru(self) -> tuple[BlockHash, _HostEntry] | None:
        for block_hash in self._lru:
            if block_hash not in self._pinned:
                return block_hash, self._lru.pop(block_hash)
        return None

    # ---- swap space ---------------------------------------------------------------------------

    def num_free(self) -> int:
        """Slots swap can take: free ones and those of unpinned cached blocks."""
        return len(self._free) + len(self._lru) - len(self._pinned)

    def take(self, n: int) -> list[int]:
        """Lend n slots to swap, evicting cached blocks LRU first (listed in `displaced`)."""
        if n > self.num_free():
            raise ValueError(f"asked for {n} host blocks, only {self.num_free()} available")
        slots: list[int] = []
        while len(slots) < n:
            if self._free:
                slots.append(self._free.pop())
            else:
                victim = self._evict_lru()
                assert victim is not None  # num_free() counted an unpinned cached block
                self.displaced.append(victim)
                slots.append(victim[1].slot)
        self._lent.update(slots)
        return slots

    def release(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._lent.remove(slot)
            self._free.append(slot)

    def check_integrity(self, held: Sequence[int]) -> None:
        assert sorted(held) == sorted(self._lent), "swap holds other host slots than the tier lent"
        cached = [entry.slot for entry in self._lru.values()]
        assert sorted([*self._free, *cached, *self._lent]) == list(range(self.num_slots)), (
            "host slots lost or held twice"
        )
        assert self._pinned <= self._lru.keys(), "a pinned block is not cached"


# ---- both tiers, as the manager and the runner see them --------------------------------------


@dataclass(slots=True)
class OffloadStats:
    saved: int  # evicted device blocks put into a tier
    loaded_host: int  # prefix blocks loaded back from host memory
    loaded_disk: int  # ... and from disk
    spilled: int  # blocks sent to disk on leaving host memory (host tier full, or none)
    written: int  # block files written (write-through and spills)
    writes_dropped: int  # blocks never written: the disk queue was full
    dropped: int  # blocks that fell off the last tier
    bad_files: int  # corrupt, truncated or foreign files skipped
    host_slots: int
    host_cached: int
    disk_blocks: int
    disk_bytes: int


class _Staged(NamedTuple):
    saves: list[BlockSave]
    saved: Tensor | None  # their data, read before any write of the step
    load_dst: list[int]
    loaded: Tensor | None


class KVOffload:
    """The tiers behind the device pool: what the manager asks while scheduling (`contains`,
    `reserve`), and what the runner calls around its block copies (`stage`, `commit`)."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        if host is None and disk is None:
            raise ValueError("an offload needs a host tier, a disk tier or both")
        self.host = host
        self.disk = disk
        self.writes_through = disk is not None
        self._staged: dict[
            BlockHash, Tensor
        ] = {}  # disk blocks read at admission, loaded this step
        self.saved = self.loaded_host = self.loaded_disk = self.spilled = 0
        self._dropped = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, storage: KVStorage, key: bytes, ranks: int = 1
    ) -> KVOffload | None:
        """The tiers the flags ask for, shaped like the device `storage`; None when neither is set.
        `key` names the model and KV dtype (the engine's hash_extra). The `ranks` writing into the
        folder split --kv-offload-disk-size: it bounds the folder, not each rank."""
        host_bytes, folder = config.kv_offload_host_memory, config.kv_offload_dir
        disk_bytes = (config.kv_offload_disk_size or 0) // ranks  # 10 GiB by default, with a folder
        if not host_bytes and not folder:
            return None
        per_block = math.prod(storage.block_shape) * storage.dtype.itemsize
        host = disk = None
        if host_bytes:
            n = host_bytes // per_block
            if n < 1:
                raise ConfigError(
                    f"--kv-offload-host-memory {format_size(host_bytes)} holds no KV block "
                    f"({format_size(per_block)} each)"
                )
            host = HostTier(
                KVStorage(
                    storage.num_layers,
                    n,
                    storage.num_kv_heads,
                    storage.block_size,
                    storage.head_dim,
                    storage.dtype,
                    "cpu",
                )
            )
            log.info(
                "KV offload host tier: %d blocks (%s), shared with swap",
                n,
                format_size(n * per_block),
            )
        if folder:
            file_bytes = DiskTier.block_format(
                key, storage.block_shape, storage.dtype
            ).largest_file(storage.block_size)
            if disk_bytes < file_bytes:
                share = f" ({format_size(disk_bytes)} a rank)" if ranks > 1 else ""
                raise ConfigError(
                    f"--kv-offload-disk-size {format_size(config.kv_offload_disk_size or 0)}"
                    f"{share} holds no KV block (a file takes up to {format_size(file_bytes)})"
                )
            disk = DiskTier(folder, key, storage.block_shape, storage.dtype, disk_bytes)
            log.info("KV offload disk tier: %s, up to %s", disk.dir, format_size(disk_bytes))
        if not config.enable_prefix_caching:
            log.warning(
                "KV offload keeps prefix-cache blocks: with prefix caching off it only holds swap"
            )
        return cls(host, disk)

    # ---- scheduling side ----------------------------------------------------------------------

    def contains(self, block_hash: BlockHash, token_ids: TokenIds) -> bool:
        return (self.host is not None and self.host.find(block_hash, token_ids) is not None) or (
            self.disk is not None and self.disk.contains(block_hash, token_ids)
        )

    def reserve(
        self,
        blocks: Sequence[tuple[BlockHash, TokenIds]],
        agree: Callable[[int], int] | None = None,
    ) -> int:
        """Make the leading run of these blocks loadable this step: pin host slots, read and check
        disk files now. Returns the run's length; the first block that fails (a bad file) ends it.
        `agree` (tensor parallelism) turns this rank's run into the one every rank can load."""
        read: dict[BlockHash, Tensor] = {}
        n = len(blocks)
        for i, (block_hash, token_ids) in enumerate(blocks):
            if self.host is not None and self.host.find(block_hash, token_ids) is not None:
                continue
            data = self.disk.read(block_hash, token_ids) if self.disk is not None else None
            if data is None:
                n = i
                break
            read[block_hash] = data
        if agree is not None:
            n = agree(n)
        for block_hash, _ in blocks[:n]:
            if block_hash in read:
                self._staged[block_hash] = read[block_hash]
            else:
                assert self.host is not None  # found there above
                self.host.pin(block_hash)
        return n

    # ---- runner side --------------------------------------------------------------------------

    def stage(self, storage: KVStorage, saves: list[BlockSave], loads: list[BlockLoad]) -> _Staged:
        """Reads only, before the step's block copies: device blocks to save, tier blocks to load,
        and cached host blocks whose slots swap-out is about to overwrite (they go to disk now)."""
        disk = self.disk
        if self.host is None and disk is not None and saves:  # disk only: written through, no copy
            kept = [s for s in saves if disk.needs(s.block_hash)]
            self.saved += len(saves) - len(kept)
            self.spilled += len(saves) - len(kept)
            saves = kept
        saved = storage.read_blocks([s.block_id for s in saves]).cpu() if saves else None
        loaded = torch.stack([self._take(load.block_hash) for load in loads]) if loads else None
        if self.host is not None:
            for block_hash, entry in self.host.displaced:
                self._spill_slot(block_hash, entry.token_ids, entry.slot)
            self.host.displaced.clear()
            self.host.unpin_all()
        self._staged.clear()
        return _Staged(saves, saved, [load.dst for load in loads], loaded)

    def _take(self, block_hash: BlockHash) -> Tensor:
        data = self._staged.get(block_hash)
        if data is not None:
            self.loaded_disk += 1
            return data
        self.loaded_host += 1
        assert self.host is not None  # reserve() pinned it in the host tier
        return self.host.storage.read_blocks([self.host.slot(block_hash)])[0]

    def commit(self, storage: KVStorage, staged: _Staged) -> None:
        """Writes, after the step's block copies: loaded blocks into the device, saved ones into
        the tiers."""
        if staged.load_dst:
            assert staged.loaded is not None
            storage.write_blocks(staged.load_dst, staged.loaded)
        if staged.saves:
            assert staged.saved is not None
            for save, data in zip(staged.saves, staged.saved):
                self._save(save.block_hash, save.token_ids, data)

    def _save(self, block_hash: BlockHash, token_ids: TokenIds, data: Tensor) -> None:
        self.saved += 1
        if self.host is None:
            self._spill(block_hash, token_ids, data)
            return
        if self.host.touch(block_hash):  # loaded from here earlier: same data
            return
        got = self.host.insert(block_hash, token_ids)
        if got is None:  # every slot lent to swap
            self._spill(block_hash, token_ids, data)
            return
        slot, victim = got
        if victim is not None:
            victim_hash, entry = victim
            self._spill_slot(victim_hash, entry.token_ids, slot)
        self.host.storage.write_blocks([slot], data[None])

    def _spill(self, block_hash: BlockHash, token_ids: TokenIds, data: Tensor) -> None:
        """A block leaving host memory (or evicted with no host tier): to disk if there is one.
        Usually written through already, so nothing is queued."""
        if self.disk is None:
            self._dropped += 1
        elif self.disk.put(block_hash, token_ids, data):  # a drop counts in disk.writes_dropped
            self.spilled += 1

    def _spill_slot(self, block_hash: BlockHash, token_ids: TokenIds, slot: int) -> None:
        """A cached host block leaving its slot: read it only if the disk lacks it."""
        if self.disk is not None and not self.disk.needs(block_hash):
            self.spilled += 1
        elif self.disk is not None:
            assert self.host is not None  # a slot is a host-tier slot
            self._spill(block_hash, token_ids, self.host.storage.read_blocks([slot])[0])
        else:
            self._dropped += 1

    def write_through(self, storage: KVStorage, writes: list[BlockSave]) -> None:
        """After the forward that filled them: copy the blocks the disk lacks off the device (as
        many as its queue takes; the rest are dropped and counted) and queue them. Never waits."""
        disk = self.disk
        assert disk is not None  # writes through only to a disk tier
        todo = [w for w in writes if disk.needs(w.block_hash)]
        room = disk.room()
        if len(todo) > room:
            disk.writes_dropped += len(todo) - room
            del todo[room:]
        if not todo:
            return
        data = storage.read_blocks([w.block_id for w in todo]).cpu()
        for w, block in zip(todo, data):
            disk.put(w.block_hash, w.token_ids, block)

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        """Graceful shutdown: write what is queued, stop the disk writer."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> OffloadStats:
        host, disk = self.host, self.disk
        return OffloadStats(
            saved=self.saved,
            loaded_host=self.loaded_host,
            loaded_disk=self.loaded_disk,
            spilled=self.spilled,
            written=disk.written if disk is not None else 0,
            writes_dropped=disk.writes_dropped if disk is not None else 0,
            dropped=self._dropped + (disk.dropped if disk is not None else 0),
            bad_files=disk.bad_files if disk is not None else 0,
            host_slots=host.num_slots if host is not None else 0,
            host_cached=host.num_cached if host is not None else 0,
            disk_blocks=disk.num_blocks if disk is not None else 0,
            disk_bytes=disk.bytes_used if disk is not None else 0,
        )

"""Tiered KV offload: cached prefix blocks evicted from the device live on in host memory, then on disk.

    device pool --evicted--> host tier (LRU slots) --full--> disk tier (a file per block) --full--> gone
         ^                        |                               |
         +------- prefix hit -----+-------------------------------+

Blocks are keyed by their chained block hash (blake2b over the parent hash,
the token ids, the model fingerprint and the KV dtype), which is stable across
processes, so the disk tier outlives the engine: a new engine on the same model
and KV dtype indexes the folder at start-up and finds what the last one wrote.
Every entry also keeps its token ids, compared on each hit as the device cache
does, so even a hash collision cannot hand out wrong K/V.

One step, as the manager plans it and the runner carries it out:

    scheduling  a cached device block is evicted    -> BlockSave (recorded; nothing moves yet)
                admission continues the prefix match in the tiers -> `reserve`: a host slot is
                pinned, a disk file is read and checked now (a bad one is skipped before its
                tokens count as computed)             -> BlockLoad into a fresh device block
    runner      stage:  reads only: the device blocks to save, the blocks to load, and cached
                        host blocks that swap-out will overwrite (sent to disk here)
                swap out, copy-on-write, swap in      (unchanged)
                commit: writes: the loaded blocks into the device, the saved blocks into the
                        host tier (whose LRU block goes to disk)

Reading everything first means no write of the step clobbers data the step
still needs: evicted device blocks are read before any device write, and the
host slots that loads and swap-ins read are only overwritten at commit.

The host tier is also the swap space: swap-out takes free slots first, then
the slots of the least recently used cached blocks (which go to disk), so one
budget, `--kv-offload-host-memory`, holds both; live requests come first.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from pagedkv.config import ConfigError, EngineConfig, format_size
from pagedkv.kv.block_pool import BlockHash
from pagedkv.kv.manager import BlockLoad, BlockSave
from pagedkv.kv.storage import KVStorage

log = logging.getLogger("pagedkv.offload")

TokenIds = tuple[int, ...]


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
        self._free = list(range(self.num_slots - 1, -1, -1))     # pop() hands out 0 first
        self._lru: OrderedDict[BlockHash, _HostEntry] = OrderedDict()
        self._pinned: set[BlockHash] = set()                      # read by a load this step
        self._lent: set[int] = set()
        self.displaced: list[tuple[BlockHash, _HostEntry]] = []   # evicted for swap, data not yet moved

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

    def insert(self, block_hash: BlockHash, token_ids: TokenIds) -> tuple[int, tuple[BlockHash, _HostEntry] | None] | None:
        """A slot for a new cached block: a free one, else the LRU block's, returned as the victim so the
        caller can move its data out first. None when every slot is lent or pinned."""
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
        slots = []
        while len(slots) < n:
            if self._free:
                slots.append(self._free.pop())
            else:
                victim = self._evict_lru()
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
        assert sorted([*self._free, *cached, *self._lent]) == list(range(self.num_slots)), \
            "host slots lost or held twice"
        assert self._pinned <= self._lru.keys(), "a pinned block is not cached"


# ---- disk -------------------------------------------------------------------------------------

MAGIC = b"PKVB"
VERSION = 1
SUFFIX = ".kvb"
_PREFIX = struct.Struct("<4sHI")      # magic, format version, header length
_ALIGN = 64                           # the payload starts at a multiple of this
_MAX_HEADER = 1 << 20


class BadFile(Exception):
    """A block file that cannot be used. One to `keep` (another model's, another format version, or
    unreadable right now) is left alone; any other (corrupt, truncated) is deleted."""

    def __init__(self, reason: str, keep: bool = False) -> None:
        super().__init__(reason)
        self.keep = keep


@dataclass(slots=True)
class _DiskEntry:
    token_ids: TokenIds
    size: int


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class DiskTier:
    """One file per block under `root/<digest of key and layout>/`, LRU by last use, at most max_bytes.

    A file is: magic, format version, header length, a JSON header (key, block hash, token ids,
    dtype, shape, payload size, blake2b of the payload; padded so the payload is aligned), then the
    payload (the block as `KVStorage.read_blocks` gives it). Files are written to a temporary name
    and renamed, so a reader sees a whole file or none; the checksum catches the rest.
    """

    def __init__(self, root: str | Path, key: bytes, block_shape: Sequence[int], dtype: torch.dtype,
                 max_bytes: int) -> None:
        self.key = key.decode("utf-8", "replace")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.payload_size = math.prod(self.block_shape) * dtype.itemsize
        layout = f"{self.key}|{list(self.block_shape)}|{dtype}".encode()
        self.dir = Path(root) / hashlib.blake2b(layout, digest_size=8).hexdigest()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--kv-offload-dir: cannot create {self.dir}: {e.strerror}") from None
        self.max_bytes = max_bytes
        self._index: OrderedDict[BlockHash, _DiskEntry] = OrderedDict()
        self.bytes_used = 0
        self.bad_files = 0
        self.dropped = 0
        self._scan()

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """Index what earlier engines left here (least recently written first), then enforce the limit."""
        found = []
        for path in self.dir.iterdir():
            try:
                if path.name.endswith(".tmp"):            # a write that never finished
                    path.unlink()
                elif path.suffix == SUFFIX:
                    found.append((path.stat().st_mtime_ns, path))
            except OSError:
                continue
        for _, path in sorted(found):
            try:
                block_hash = BlockHash(bytes.fromhex(path.stem))
                with open(path, "rb") as f:
                    head = f.read(_PREFIX.size)
                    if len(head) == _PREFIX.size:
                        head += f.read(min(_PREFIX.unpack(head)[2], _MAX_HEADER))
                    size = os.fstat(f.fileno()).st_size
                header, _ = self._parse(head, size, block_hash)
            except ValueError:
                self._skip(path, None, BadFile("not a block file name"))
                continue
            except BadFile as e:
                self._skip(path, None, e)
                continue
            except OSError as e:
                self._skip(path, None, BadFile(f"unreadable: {e.strerror}", keep=True))
                continue
            self._index[block_hash] = _DiskEntry(tuple(header["token_ids"]), size)
            self.bytes_used += size
        self._make_room(0)
        if self._index:
            log.info("KV offload: %d blocks (%s) on disk from earlier runs in %s",
                     len(self._index), format_size(self.bytes_used), self.dir)

    def _parse(self, head: bytes | bytearray, file_size: int, block_hash: BlockHash) -> tuple[dict, int]:
        """Check a file's header against this tier and its name; returns (header, payload offset)."""
        if len(head) < _PREFIX.size:
            raise BadFile("truncated header")
        magic, version, header_len = _PREFIX.unpack_from(head)
        if magic != MAGIC:
            raise BadFile("not a pagedkv block file")
        if version != VERSION:
            raise BadFile(f"format version {version}", keep=True)
        offset = _PREFIX.size + header_len
        if header_len > _MAX_HEADER or len(head) < offset:
            raise BadFile("truncated header")
        try:
            header = json.loads(bytes(head[_PREFIX.size:offset]))
        except ValueError:
            raise BadFile("unreadable header") from None
        if not isinstance(header, dict):
            raise BadFile("unreadable header")
        if header.get("key") != self.key:
            raise BadFile(f"written for {header.get('key')!r}", keep=True)
        if header.get("dtype") != str(self.dtype) or header.get("shape") != list(self.block_shape):
            raise BadFile(f"block layout {header.get('shape')} {header.get('dtype')}", keep=True)
        if header.get("hash") != block_hash.hex():
            raise BadFile("hash differs from the file name")
        tokens = header.get("token_ids")
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise BadFile("bad token ids")
        if header.get("nbytes") != self.payload_size:
            raise BadFile("wrong payload size")
        if file_size != offset + self.payload_size:
            raise BadFile(f"truncated ({file_size} of {offset + self.payload_size} bytes)"
                          if file_size < offset + self.payload_size else "trailing bytes")
        return header, offset

    def _skip(self, path: Path, block_hash: BlockHash | None, err: BadFile) -> None:
        """Never crash, never use it: warn, forget it, and delete it unless it is one to keep."""
        self.bad_files += 1
        entry = self._index.pop(block_hash, None) if block_hash is not None else None
        if entry is not None:
            self.bytes_used -= entry.size
        if err.keep:
            log.warning("KV offload: ignoring %s (%s)", path, err)
        else:
            log.warning("KV offload: skipping bad block file %s (%s); deleted", path, err)
            _unlink(path)

    def _make_room(self, size: int) -> None:
        while self._index and self.bytes_used + size > self.max_bytes:
            block_hash, entry = self._index.popitem(last=False)
            _unlink(self._path(block_hash))
            self.bytes_used -= entry.size
            self.dropped += 1

    def contains(self, block_hash: BlockHash, token_ids: TokenIds) -> bool:
        entry = self._index.get(block_hash)
        return entry is not None and entry.token_ids == token_ids

    def read(self, block_hash: BlockHash, token_ids: TokenIds) -> Tensor | None:
        """The block, after checking its whole file; None (and the file skipped) if anything is off."""
        if not self.contains(block_hash, token_ids):
            return None
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(buf)
            header, offset = self._parse(buf, got, block_hash)
            if tuple(header["token_ids"]) != token_ids:
                raise BadFile("token ids differ from the index")
            if hashlib.blake2b(memoryview(buf)[offset:], digest_size=16).hexdigest() != header.get("blake2b"):
                raise BadFile("checksum mismatch")
        except BadFile as e:
            self._skip(path, block_hash, e)
            return None
        except OSError as e:
            self._skip(path, block_hash, BadFile(f"unreadable: {e.strerror}", keep=True))
            return None
        self._index.move_to_end(block_hash)
        numel = self.payload_size // self.dtype.itemsize
        return torch.frombuffer(buf, dtype=self.dtype, count=numel, offset=offset).view(self.block_shape)

    def write(self, block_hash: BlockHash, token_ids: TokenIds, block: Tensor) -> bool:
        """Store a block (CPU, `block_shape`) atomically; False if it cannot be (limit, OS error)."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return True
        payload = block.contiguous().view(-1).view(torch.uint8).numpy()
        header = json.dumps({
            "key": self.key, "hash": block_hash.hex(), "token_ids": list(token_ids), "dtype": str(self.dtype),
            "shape": list(self.block_shape), "nbytes": payload.nbytes,
            "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
        header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
        size = _PREFIX.size + len(header) + payload.nbytes
        if size > self.max_bytes:
            self.dropped += 1
            return False
        self._make_room(size)
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(MAGIC, VERSION, len(header)))
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("KV offload: cannot write %s (%s); block dropped", path, e.strerror)
            _unlink(tmp)
            self.dropped += 1
            return False
        self._index[block_hash] = _DiskEntry(token_ids, size)
        self.bytes_used += size
        return True


# ---- both tiers, as the manager and the runner see them --------------------------------------


@dataclass(slots=True)
class OffloadStats:
    saved: int             # evicted device blocks put into a tier
    loaded_host: int       # prefix blocks loaded back from host memory
    loaded_disk: int       # ... and from disk
    spilled: int           # blocks written to disk (host tier full, or no host tier)
    dropped: int           # blocks that fell off the last tier
    bad_files: int         # corrupt, truncated or foreign files skipped
    host_slots: int
    host_cached: int
    disk_blocks: int
    disk_bytes: int


class _Staged(NamedTuple):
    saves: list[BlockSave]
    saved: Tensor | None         # their data, read before any write of the step
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
        self._staged: dict[BlockHash, Tensor] = {}    # disk blocks read at admission, loaded this step
        self.saved = self.loaded_host = self.loaded_disk = self.spilled = 0
        self._dropped = 0

    @classmethod
    def from_config(cls, config: EngineConfig, storage: KVStorage, key: bytes) -> KVOffload | None:
        """The tiers the flags ask for, shaped like the device `storage`; None when neither is set.
        `key` names the model and KV dtype (the engine's hash_extra)."""
        host_bytes, folder = config.kv_offload_host_memory, config.kv_offload_dir
        if not host_bytes and not folder:
            return None
        per_block = math.prod(storage.block_shape) * storage.dtype.itemsize
        host = disk = None
        if host_bytes:
            n = host_bytes // per_block
            if n < 1:
                raise ConfigError(f"--kv-offload-host-memory {format_size(host_bytes)} holds no KV block "
                                  f"({format_size(per_block)} each)")
            host = HostTier(KVStorage(storage.num_layers, n, storage.num_kv_heads, storage.block_size,
                                      storage.head_dim, storage.dtype, "cpu"))
            log.info("KV offload host tier: %d blocks (%s), shared with swap", n, format_size(n * per_block))
        if folder:
            if config.kv_offload_disk_size < per_block:
                raise ConfigError(f"--kv-offload-disk-size {format_size(config.kv_offload_disk_size)} holds no "
                                  f"KV block ({format_size(per_block)} each)")
            disk = DiskTier(folder, key, storage.block_shape, storage.dtype, config.kv_offload_disk_size)
            log.info("KV offload disk tier: %s, up to %s", disk.dir, format_size(config.kv_offload_disk_size))
        if not config.enable_prefix_caching:
            log.warning("KV offload keeps prefix-cache blocks: with prefix caching off it only holds swap")
        return cls(host, disk)

    # ---- scheduling side ----------------------------------------------------------------------

    def contains(self, block_hash: BlockHash, token_ids: TokenIds) -> bool:
        return ((self.host is not None and self.host.find(block_hash, token_ids) is not None)
                or (self.disk is not None and self.disk.contains(block_hash, token_ids)))

    def reserve(self, blocks: Sequence[tuple[BlockHash, TokenIds]]) -> int:
        """Make the leading run of these blocks loadable this step: pin host slots, read and check disk
        files now. Returns the run's length; the first block that fails (a bad file) ends it."""
        for i, (block_hash, token_ids) in enumerate(blocks):
            if self.host is not None and self.host.find(block_hash, token_ids) is not None:
                self.host.pin(block_hash)
                continue
            data = self.disk.read(block_hash, token_ids) if self.disk is not None else None
            if data is None:
                return i
            self._staged[block_hash] = data
        return len(blocks)

    # ---- runner side --------------------------------------------------------------------------

    def stage(self, storage: KVStorage, saves: list[BlockSave], loads: list[BlockLoad]) -> _Staged:
        """Reads only, before the step's block copies: device blocks to save, tier blocks to load, and
        cached host blocks whose slots swap-out is about to overwrite (they go to disk now)."""
        saved = storage.read_blocks([s.block_id for s in saves]).cpu() if saves else None
        loaded = torch.stack([self._take(load.block_hash) for load in loads]) if loads else None
        if self.host is not None:
            for block_hash, entry in self.host.displaced:
                self._spill(block_hash, entry.token_ids, self.host.storage.read_blocks([entry.slot])[0])
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
        return self.host.storage.read_blocks([self.host.slot(block_hash)])[0]

    def commit(self, storage: KVStorage, staged: _Staged) -> None:
        """Writes, after the step's block copies: loaded blocks into the device, saved ones into the tiers."""
        if staged.load_dst:
            storage.write_blocks(staged.load_dst, staged.loaded)
        if staged.saves:
            for save, data in zip(staged.saves, staged.saved):
                self._save(save.block_hash, save.token_ids, data)

    def _save(self, block_hash: BlockHash, token_ids: TokenIds, data: Tensor) -> None:
        self.saved += 1
        if self.host is None:
            self._spill(block_hash, token_ids, data)
            return
        if self.host.touch(block_hash):               # loaded from here earlier: same data
            return
        got = self.host.insert(block_hash, token_ids)
        if got is None:                                # every slot lent to swap
            self._spill(block_hash, token_ids, data)
            return
        slot, victim = got
        if victim is not None:
            victim_hash, entry = victim
            self._spill(victim_hash, entry.token_ids, self.host.storage.read_blocks([slot])[0])
        self.host.storage.write_blocks([slot], data[None])

    def _spill(self, block_hash: BlockHash, token_ids: TokenIds, data: Tensor) -> None:
        """A block leaving host memory (or evicted with no host tier): to disk if there is one."""
        if self.disk is None:
            self._dropped += 1
        elif self.disk.write(block_hash, token_ids, data):     # a failed write counts in disk.dropped
            self.spilled += 1

    def stats(self) -> OffloadStats:
        host, disk = self.host, self.disk
        return OffloadStats(
            saved=self.saved, loaded_host=self.loaded_host, loaded_disk=self.loaded_disk, spilled=self.spilled,
            dropped=self._dropped + (disk.dropped if disk is not None else 0),
            bad_files=disk.bad_files if disk is not None else 0,
            host_slots=host.num_slots if host is not None else 0,
            host_cached=host.num_cached if host is not None else 0,
            disk_blocks=disk.num_blocks if disk is not None else 0,
            disk_bytes=disk.bytes_used if disk is not None else 0)

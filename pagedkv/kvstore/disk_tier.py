"""The disk KV tier: a checksummed file per block, written in the background, kept across restarts.

    engine thread                              writer thread
    put(hash, tokens, block copy) --bounded queue--> temp file, fsync, rename --> index
        (full queue: dropped and counted,              (LRU files over the size limit deleted)
         never waits)

The engine thread only hands over a copy it already made; the file is encoded,
checksummed and written on the writer thread, so a step never waits on the
disk. A queued block is found and read from that copy until its file is there,
so what the engine sees does not depend on how fast the disk is.

A file appears under its final name only once it is whole (written to a
temporary name in the same folder, fsynced, renamed), so a process killed at
any moment leaves whole files and, at worst, a temporary file, which the next
start deletes (unless its writer, another engine on the same folder, still
runs). Every read checks the header and the payload's checksum.
`close` drains the queue: a graceful shutdown loses nothing queued.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from pagedkv.config import ConfigError, format_size
from pagedkv.kv.hashing import BlockHash, TokenIds
from pagedkv.kvstore.block_file import SUFFIX, TMP_SUFFIX, BadFile, BlockFormat

T = TypeVar("T")
log = logging.getLogger("pagedkv.offload")

TMP_MAX_AGE_S = 600  # a temporary file this old is abandoned, whoever wrote it
WRITE_QUEUE_BYTES = 256 << 20  # block copies waiting for the writer, at most
DRAIN_TIMEOUT_S = 25.0  # inside the server's 30 s wait for the engine thread


@dataclass(slots=True)
class _DiskEntry:
    token_ids: TokenIds
    size: int


class _Write(NamedTuple):
    block_hash: BlockHash
    token_ids: TokenIds
    data: Tensor


def _abandoned(tmp: Path) -> bool:
    """A temporary file whose writer is gone: its pid (in the name) is not running, or it is old.
    Another engine sharing the folder may be writing the others right now."""
    try:
        pid = int(tmp.name[: -len(TMP_SUFFIX)].rsplit(".", 1)[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return True
    except PermissionError:  # alive, someone else's
        pass
    try:
        return time.time() - tmp.stat().st_mtime > TMP_MAX_AGE_S
    except OSError:
        return False


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class DiskTier:
    """A file per block (`pagedkv.kvstore.block_file`; the payload is the block as
    `KVStorage.read_blocks` gives it) under `root/<digest of key and layout>/`, LRU by last use,
    at most max_bytes.

    Thread safety: the engine thread calls everything but the writer loop; `_lock` guards the index,
    the byte count and the set of queued hashes, and is never held during file I/O.
    """

    def __init__(
        self,
        root: str | Path,
        key: bytes,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        max_bytes: int,
        queue_blocks: int | None = None,
    ) -> None:
        self.format = self.block_format(key, block_shape, dtype)
        self.dir = Path(root) / self.format.folder
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--kv-offload-dir: cannot create {self.dir}: {e.strerror}") from None
        self._check_writable()
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _DiskEntry] = OrderedDict()
        self.bytes_used = 0  # files indexed, plus the one being written
        self.bad_files = 0
        self.dropped = 0  # files deleted for the size limit, and writes that failed
        self.written = 0  # files written
        self._failed_writes = 0  # in a row: one warning for a full disk, not one per block
        self.writes_dropped = 0  # blocks never written: the queue was full (or closed)
        self._queued: dict[BlockHash, _Write] = {}
        if queue_blocks is None:
            queue_blocks = max(8, WRITE_QUEUE_BYTES // self.format.payload_size)
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=queue_blocks)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._scan()

    @staticmethod
    def block_format(key: bytes, block_shape: Sequence[int], dtype: torch.dtype) -> BlockFormat:
        return BlockFormat(key.decode("utf-8", "replace"), tuple(block_shape), dtype)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    # ---- start-up -----------------------------------------------------------------------------

    def _check_writable(self) -> None:
        """Refuse a folder we cannot write at start: serving would fail every block with a
        warning each, and keep nothing for a restart."""
        probe = self.dir / f"probe.{os.getpid()}{TMP_SUFFIX}"  # a killed start's is cleaned up
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        except OSError as e:
            raise ConfigError(f"--kv-offload-dir: cannot write {self.dir}: {e.strerror}") from None
        _unlink(probe)

    def _scan(self) -> None:
        """Index what earlier engines left here (least recently written first), delete what a killed
        one left half-written, then enforce the limit."""
        found = []
        for path in self.dir.iterdir():
            try:
                if path.name.endswith(TMP_SUFFIX):
                    if _abandoned(path):
                        path.unlink()
                elif path.suffix == SUFFIX:
                    found.append((path.stat().st_mtime_ns, path))
            except OSError:
                continue
        for _, path in sorted(found):
            try:
                block_hash = BlockHash(bytes.fromhex(path.stem))
            except ValueError:
                self._skip(path, None, BadFile("not a block file name"))
                continue
            self._adopt(path, block_hash)
        for victim in self._make_room(0):
            _unlink(victim)
        if self._index:
            log.info(
                "KV offload: %d blocks (%s) on disk from earlier runs in %s",
                len(self._index),
                format_size(self.bytes_used),
                self.dir,
            )

    def _checked(
        self, path: Path, block_hash: BlockHash, load: Callable[[BufferedReader], T]
    ) -> T | None:
        """`load(file)`, or None when the file is gone (forgotten: a plain miss) or fails a check
        (skipped: never crash, never use it)."""
        try:
            # non-blocking, so that a FIFO someone named *.kvb cannot hang the engine on open
            with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise BadFile("not a regular file", keep=True)
                return load(f)
        except FileNotFoundError:  # deleted since: the size limit, or a sibling's
            with self._lock:
                self._forget(block_hash)
        except BadFile as e:
            self._skip(path, block_hash, e)
        except OSError as e:
            self._skip(path, block_hash, BadFile(f"unreadable: {e.strerror}", keep=True))
        return None

    def _adopt(self, path: Path, block_hash: BlockHash) -> _DiskEntry | None:
        """Index a block file found on disk (an earlier run's, or a sibling replica's sharing this
        folder) after checking its header; None if it is missing or bad."""

        def header_entry(f: BufferedReader) -> _DiskEntry:
            size = os.fstat(f.fileno()).st_size
            header, _ = self.format.parse(self.format.read_head(f), size, block_hash)
            return _DiskEntry(tuple(header["token_ids"]), size)

        entry = self._checked(path, block_hash, header_entry)
        if entry is not None:
            with self._lock:
                if block_hash not in self._index:
                    self._index[block_hash] = entry
                    self.bytes_used += entry.size
        return entry

    def _skip(self, path: Path, block_hash: BlockHash | None, err: BadFile) -> None:
        """Never crash, never use it: warn, forget it, and delete it unless it is one to keep."""
        with self._lock:
            self.bad_files += 1
            self._forget(block_hash)
        if err.keep:
            log.warning("KV offload: ignoring %s (%s)", path, err)
        else:
            log.warning("KV offload: skipping bad block file %s (%s); deleted", path, err)
            _unlink(path)

    def _forget(self, block_hash: BlockHash | None) -> None:
        entry = self._index.pop(block_hash, None) if block_hash is not None else None
        if entry is not None:
            self.bytes_used -= entry.size

    def _make_room(self, size: int) -> list[Path]:
        """Drop LRU entries until `size` more bytes fit; returns their files to delete (locked)."""
        victims = []
        while self._index and self.bytes_used + size > self.max_bytes:
            block_hash, entry = self._index.popitem(last=False)
            victims.append(self._path(block_hash))
            self.bytes_used -= entry.size
            self.dropped += 1
        return victims

    # ---- reads (engine thread) ----------------------------------------------------------------

    def contains(self, block_hash: BlockHash, token_ids: TokenIds) -> bool:
        """Indexed, queued, or written since by another engine sharing this folder (a replica)."""
        with self._lock:
            entry = self._index.get(block_hash) or self._queued.get(block_hash)
        if entry is None:
            entry = self._adopt(self._path(block_hash), block_hash)
        return entry is not None and entry.token_ids == token_ids

    def read(self, block_hash: BlockHash, token_ids: TokenIds) -> Tensor | None:
        """The block, after checking its whole file (or its queued copy); None (and the file
        skipped) if anything is off. Do not modify the result."""
        with self._lock:
            entry = self._index.get(block_hash)
            queued = self._queued.get(block_hash) if entry is None else None
        if queued is not None:
            return queued.data if queued.token_ids == token_ids else None
        if entry is None or entry.token_ids != token_ids:
            return None

        def whole_block(f: BufferedReader) -> Tensor:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            del buf[f.readinto(buf) :]
            return self.format.decode(buf, block_hash, token_ids)

        data = self._checked(self._path(block_hash), block_hash, whole_block)
        if data is None:
            return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return data

    # ---- writes -------------------------------------------------------------------------------

    def needs(self, block_hash: BlockHash) -> bool:
        """Neither on disk nor queued; a block already on disk counts as just used."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return False
            return block_hash not in self._queued

    def room(self) -> int:
        """Blocks `put` can queue now without dropping any."""
        return 0 if self._closed else self._queue.maxsize - self._queue.qsize()

    def put(self, block_hash: BlockHash, token_ids: TokenIds, data: Tensor) -> bool:
        """Queue a block for the writer thread without waiting. `data` (CPU, `block_shape`) must not
        change afterwards. False when it was dropped (queue full or closed; counted)."""
        if not self.needs(block_hash):
            return True
        if self.room() <= 0:
            self.writes_dropped += 1
            return False
        if self._thread is None:
            self._start()
        item = _Write(block_hash, token_ids, data)
        with self._lock:
            self._queued[block_hash] = item
        self._queue.put_nowait(item)
        return True

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-disk", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a script that never calls close still loses nothing

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.write(*item)
            except Exception:  # never let one block stop the writer
                log.exception("KV offload: writing a block failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._queued.pop(item.block_hash, None)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is on disk (or dropped)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Drain the queue and stop the writer; later `put`s are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._thread is None:
            return
        pending = self._queue.qsize()
        if pending:
            log.info("KV offload: writing %d queued blocks to %s", pending, self.dir)
        self._queue.put(None)
        self._thread.join(DRAIN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("KV offload: the disk writer did not finish in %.0fs", DRAIN_TIMEOUT_S)
        self._sync_dir()

    def _sync_dir(self) -> None:
        """Make the renames durable too (the files themselves were fsynced before them)."""
        try:
            fd = os.open(self.dir, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def write(self, block_hash: BlockHash, token_ids: TokenIds, block: Tensor) -> bool:
        """Store a block (CPU, `block_shape`) atomically, now; False if it cannot be (limit, OS
        error). The writer thread's job; callable directly when nothing is queued."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
        payload = block.contiguous().view(-1).view(torch.uint8).numpy()
        head = self.format.encode(block_hash, token_ids, payload)
        size = len(head) + payload.nbytes
        with self._lock:
            if size > self.max_bytes:
                self.dropped += 1
                return False
            victims = self._make_room(size)
            self.bytes_used += size  # reserved while the file is written
        for victim in victims:
            _unlink(victim)
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload.data)  # the array's buffer, no copy
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            if not self._failed_writes:
                log.warning(
                    "KV offload: cannot write %s (%s); blocks are dropped until writes succeed",
                    path,
                    e.strerror,
                )
            self._failed_writes += 1
            _unlink(tmp)
            with self._lock:
                self.bytes_used -= size
                self.dropped += 1
            return False
        if self._failed_writes:
            log.warning("KV offload: writing again; %d blocks were dropped", self._failed_writes)
            self._failed_writes = 0
        with self._lock:
            self._index[block_hash] = _DiskEntry(token_ids, size)
            self.written += 1
        return True

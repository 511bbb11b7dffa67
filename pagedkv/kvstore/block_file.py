"""The on-disk format of one KV block, and every check a file passes before its data is used.

    "PKVB" | version u16 | header length u32 | JSON header, space-padded | payload (64-aligned)

The JSON header holds the key (model fingerprint and KV dtype), the block hash
(also the file's name), the token ids, dtype, shape, payload size and a blake2b
of the payload. A file that fails a check raises BadFile; nothing here touches
the file system, so the disk tier decides what to delete.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor

from pagedkv.kv.hashing import BlockHash, TokenIds

MAGIC = b"PKVB"
VERSION = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_PREFIX = struct.Struct("<4sHI")  # magic, format version, header length
_ALIGN = 64  # the payload starts at a multiple of this
_MAX_HEADER = 1 << 20


class BadFile(Exception):
    """A block file that cannot be used. One to `keep` (another model's, another format version,
    or unreadable right now) is left alone; any other (corrupt, truncated) is deleted."""

    def __init__(self, reason: str, keep: bool = False) -> None:
        super().__init__(reason)
        self.keep = keep


def checksum(payload) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """Files of one model, KV dtype and block layout."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def payload_size(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def folder(self) -> str:
        """The folder name for this format: files of other models and layouts never mix."""
        layout = f"{self.key}|{list(self.shape)}|{self.dtype}".encode()
        return hashlib.blake2b(layout, digest_size=8).hexdigest()

    def largest_file(self, block_tokens: int) -> int:
        """Bytes of a file for a block of `block_tokens` tokens with the widest token ids."""
        payload = np.zeros(self.payload_size, np.uint8)
        head = self.encode(BlockHash(bytes(32)), (2**31 - 1,) * block_tokens, payload)
        return len(head) + self.payload_size

    def encode(self, block_hash: BlockHash, token_ids: TokenIds, payload: np.ndarray) -> bytes:
        """Everything before the payload: prefix and padded header."""
        header = json.dumps(
            {
                "key": self.key,
                "hash": block_hash.hex(),
                "token_ids": list(token_ids),
                "dtype": str(self.dtype),
                "shape": list(self.shape),
                "nbytes": payload.nbytes,
                "blake2b": checksum(payload),
            }
        ).encode()
        header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
        return _PREFIX.pack(MAGIC, VERSION, len(header)) + header

    @staticmethod
    def read_head(f: BinaryIO) -> bytes:
        """The prefix and header of an open file (what `parse` needs), without the payload."""
        head = f.read(_PREFIX.size)
        if len(head) == _PREFIX.size:
            head += f.read(min(_PREFIX.unpack(head)[2], _MAX_HEADER))
        return head

    def parse(
        self, head: bytes | bytearray, file_size: int, block_hash: BlockHash
    ) -> tuple[dict, int]:
        """Check a file's header against this format and its name; returns (header, payload
        start)."""
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
            header = json.loads(bytes(head[_PREFIX.size : offset]))
        except ValueError:
            raise BadFile("unreadable header") from None
        if not isinstance(header, dict):
            raise BadFile("unreadable header")
        if header.get("key") != self.key:
            raise BadFile(f"written for {header.get('key')!r}", keep=True)
        if header.get("dtype") != str(self.dtype) or header.get("shape") != list(self.shape):
            raise BadFile(f"block layout {header.get('shape')} {header.get('dtype')}", keep=True)
        if header.get("hash") != block_hash.hex():
            raise BadFile("hash differs from the file name")
        tokens = header.get("token_ids")
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise BadFile("bad token ids")
        if header.get("nbytes") != self.payload_size:
            raise BadFile("wrong payload size")
        want = offset + self.payload_size
        if file_size != want:
            raise BadFile(
                f"truncated ({file_size} of {want} bytes)" if file_size < want else "trailing bytes"
            )
        return header, offset

    def decode(self, buf: bytearray, block_hash: BlockHash, token_ids: TokenIds) -> Tensor:
        """A whole file's block, once its header, token ids and checksum all agree."""
        header, offset = self.parse(buf, len(buf), block_hash)
        if tuple(header["token_ids"]) != token_ids:
            raise BadFile("token ids differ from the index")
        if checksum(memoryview(buf)[offset:]) != header.get("blake2b"):
            raise BadFile("checksum mismatch")
        numel = self.payload_size // self.dtype.itemsize
        return torch.frombuffer(buf, dtype=self.dtype, count=numel, offset=offset).view(self.shape)

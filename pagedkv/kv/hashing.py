"""Chained block hashes: what names a full block of tokens in every prefix cache and tier.

A sequence's `BlockHashes` is computed once and extended as its tokens arrive
(vLLM v1 keeps `request.block_hashes` the same way), so lookups, admission and
caching read hashes instead of re-hashing the prompt:

    tokens   [t0 .. t15][t16 .. t31][t32 .. t40]      B = 16, 41 tokens
    hashes   h0          h1           (partial: not hashed until full)
    h0 = H(None, t0..t15, extra + salt)   h1 = H(h0, t16..t31, extra)

A request's cache salt (vLLM's `cache_salt`) and its LoRA adapter's name enter the first block's
hash, so requests with different salts or adapters never share a cached block, and requests
without either hash as they always did. A block's hash covers its whole prefix, so one equal
hash means one equal prefix (the caches still compare the tokens, so a collision cannot hand out
wrong K/V). Only tokens the sequence really holds are hashed, never
speculative drafts: they join the token list only once verified.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
TokenIds = tuple[int, ...]

HASH_SIZE = 32


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b""
) -> BlockHash:
    """Chained hash of one full block: blake2b over parent hash, token ids and extra keys.

    Stable across processes and machines (explicit little-endian layout, no
    Python `hash()`), so a disk tier can name files by it. `extra` carries what
    changes the K/V for the same tokens (KV dtype, model fingerprint).
    """
    n = len(token_ids)
    head = b"\x00" if parent is None else b"\x01" + parent
    data = head + struct.pack(f"<I{n}q", n, *token_ids) + extra
    return BlockHash(hashlib.blake2b(data, digest_size=HASH_SIZE).digest())


def _keyed(tag: bytes, value: str | None) -> bytes:
    """A tagged, length-prefixed key, so that no salt or adapter reads as another's prefix."""
    if value is None:
        return b""
    data = value.encode("utf-8", "surrogatepass")
    return tag + struct.pack("<Q", len(data)) + data


class BlockHashes:
    """One sequence's full blocks: chained hashes and token tuples, and its token count.

    `update` hashes only the blocks filled since the last call. With `block_size` None (prefix
    caching off) nothing is hashed and only `num_tokens` is kept.
    """

    __slots__ = ("block_size", "extra", "salt", "hashes", "chunks", "num_tokens")

    def __init__(
        self,
        block_size: int | None,
        extra: bytes = b"",
        token_ids: Sequence[int] = (),
        num_tokens: int | None = None,
        salt: str | None = None,
        adapter: str | None = None,
    ) -> None:
        self.block_size = block_size
        self.extra = extra
        self.salt = _keyed(b"salt", salt) + _keyed(b"lora", adapter)  # the first block's
        self.hashes: list[BlockHash] = []
        self.chunks: list[TokenIds] = []  # the tokens of each hashed block
        self.num_tokens = 0
        self.update(token_ids, num_tokens)

    def update(self, token_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """The sequence now holds token_ids[:num_tokens] (all of them by default), which extend the
        tokens of the last call: hash the blocks they fill."""
        n = len(token_ids) if num_tokens is None else num_tokens
        if n < self.num_tokens:
            raise ValueError(f"{n} tokens after {self.num_tokens}: a sequence only grows")
        self.num_tokens = n
        bs = self.block_size
        if bs is None or n // bs == len(self.hashes):  # most tokens fill no block
            return
        hashes, chunks = self.hashes, self.chunks
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), n // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hash_block_tokens(parent, chunk, self.extra + (b"" if i else self.salt))
            hashes.append(parent)
            chunks.append(chunk)

    def copy(self) -> BlockHashes:
        """For a forked sequence: the same blocks so far, extended on its own from now on."""
        twin = BlockHashes(self.block_size, self.extra)
        twin.salt = self.salt
        twin.hashes, twin.chunks = list(self.hashes), list(self.chunks)
        twin.num_tokens = self.num_tokens
        return twin

    def __len__(self) -> int:
        return len(self.hashes)

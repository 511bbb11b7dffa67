"""One request's blocks as the manager tracks them: its block table, or its host slots while
swapped out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.kv.block_pool import Block
from pagedkv.kv.hashing import BlockHash, TokenIds


class SwappedBlock(NamedTuple):
    """A logical block of a swapped-out request."""

    host: int | None  # the host slot holding its data; None if it held no token
    cached: tuple[BlockHash, TokenIds] | None  # its prefix-cache key, if it had one


@dataclass(slots=True, eq=False)
class RequestBlocks:
    blocks: list[Block]  # device block table; empty while swapped
    num_tokens: int  # tokens held (cached prefix + allocated); the full ones are hashed
    num_cached: int  # tokens that came from the prefix cache at admission
    swapped: list[SwappedBlock] | None = None
    num_owned_blocks: int = 0  # table length before the last step's speculative lookahead


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

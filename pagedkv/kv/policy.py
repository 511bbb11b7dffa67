"""How many blocks a request may take: paging on demand, or the seeds' reservation baselines.

    paged           blocks as tokens arrive (a reservation of 0)
    reserve-output  prompt + max_tokens at admission (capped at max_model_len)
    reserve-max     max_model_len at admission, whatever the request

Every policy keeps `watermark_blocks` free at admission, so running requests can still grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.config import ALLOCATION_POLICIES, ConfigError
from pagedkv.kv.block_pool import Block
from pagedkv.kv.table import cdiv


class Admission(NamedTuple):
    """What admitting a request takes, given the prefix it reuses."""

    prefix: list[Block]  # the cached device blocks it reuses
    num_offloaded: int  # the blocks after them loaded from the offload tiers
    num_tokens: int  # tokens held once admitted
    num_new_blocks: int  # blocks to take from the free queue
    fits: bool  # room for them, the revived prefix blocks and the watermark


@dataclass(frozen=True, slots=True)
class AllocationPolicy:
    kind: str
    num_blocks: int
    block_size: int
    max_model_len: int | None
    watermark_blocks: int

    @classmethod
    def checked(
        cls,
        kind: str,
        num_blocks: int,
        block_size: int,
        max_model_len: int | None,
        watermark: float,
    ) -> AllocationPolicy:
        """The policy for a pool of num_blocks, or a ConfigError naming the flag that is off."""
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache has room for {num_blocks} blocks; "
                "give it more memory (--kv-cache-memory)"
            )
        if block_size < 1:
            raise ConfigError(f"--block-size must be a positive integer, got {block_size}")
        if kind not in ALLOCATION_POLICIES:
            raise ConfigError(
                f"--allocation-policy must be one of {', '.join(ALLOCATION_POLICIES)}"
            )
        if kind == "reserve-max" and not max_model_len:
            raise ConfigError("--allocation-policy reserve-max needs --max-model-len")
        if not 0.0 <= watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark}")
        return cls(kind, num_blocks, block_size, max_model_len, int(watermark * num_blocks))

    def reservation(self, num_known_tokens: int, max_tokens: int | None) -> int:
        """Tokens a request takes at admission, given the tokens it knows and the tokens it may
        still generate (0 under paging)."""
        if self.kind == "reserve-max":
            return self.max_model_len or 0  # set: `checked` refuses reserve-max without it
        if self.kind == "reserve-output":
            if max_tokens is None:
                return self.max_model_len or 0
            target = num_known_tokens + max_tokens
            return min(target, self.max_model_len) if self.max_model_len else target
        return 0

    def admission(
        self,
        prefix: list[Block],
        num_offloaded: int,
        num_new_tokens: int,
        num_known_tokens: int,
        max_tokens: int | None,
        num_free: int,
    ) -> Admission:
        """Size an admission that reuses prefix (and num_offloaded tier blocks after it) and
        computes num_new_tokens more, when num_free blocks are free."""
        held = (len(prefix) + num_offloaded) * self.block_size + num_new_tokens
        if held > num_known_tokens:
            raise ValueError(f"{held} tokens to hold but only {num_known_tokens} token ids given")
        if self.kind != "paged":
            held_or_reserved = max(held, self.reservation(num_known_tokens, max_tokens))
        else:
            held_or_reserved = held
        num_new = cdiv(held_or_reserved, self.block_size) - len(prefix)
        revived = sum(1 for block in prefix if block.ref_count == 0) if prefix else 0
        fits = num_new + revived + self.watermark_blocks <= num_free
        return Admission(prefix, num_offloaded, held, num_new, fits)

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of num_tokens (prompt + max_tokens) ever be admitted into the empty
        pool?"""
        tokens = num_tokens
        if self.kind == "reserve-max":
            tokens = max(num_tokens, self.max_model_len or 0)
        return cdiv(tokens, self.block_size) + self.watermark_blocks <= self.num_blocks

"""Which replica serves a request: round-robin, least-loaded, or prefix-aware with bounded load.

Pure policy code, no Ray import: the Ray Serve request router (`pagedkv.server.ray_router`)
and the multi-replica simulator (`pagedkv.sim.replicas`) run the same classes, so the
simulated hit rates are the router's. A request is known by the chained hashes of its
prompt's full blocks (pagedkv's own `hash_block_tokens`, the keys of each replica's prefix
cache); a replica's load is the number of its requests in flight.

Prefix-aware routing remembers which replicas it sent each block hash to (an LRU map) and
sends a request to the replica holding its longest known prefix, unless that replica's load
is past `load_factor` x the mean load + `slack`: then the next shorter match is tried, and
at last the least loaded replica. A hot prefix therefore spills to a second replica (which
then holds it too) instead of swamping one.
"""

from __future__ import annotations

import itertools
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar, cast

from pagedkv.config import ConfigError
from pagedkv.kv.hashing import BlockHash, BlockHashes

K = TypeVar("K", bound=Hashable)
MAX_ROUTING_BLOCKS = 256  # a prefix past 4k tokens (at 16 per block) is matched on its head
POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    max_blocks: int = MAX_ROUTING_BLOCKS,
    salt: str | None = None,
    adapter: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks, keyed apart by salt and LoRA adapter as a
    replica's prefix cache keys them (there by the adapter's files too: a router needs only to
    tell adapters apart)."""
    num_tokens = min(len(token_ids), max_blocks * block_size)
    return BlockHashes(block_size, b"", token_ids, num_tokens, salt, adapter).hashes


class RoutingPolicy(ABC):
    """Picks one of `loads`' keys (the live replicas) for a request with these block hashes."""

    name: str

    @abstractmethod
    def choose(self, hashes: Sequence[BlockHash], loads: Mapping[K, int]) -> K: ...

    def record(self, hashes: Sequence[BlockHash], replica: Hashable) -> None:  # noqa: B027 - optional hook
        """The request went to `replica` (which may not be the one chosen, if that one was full)."""

    def forget(self, replica: Hashable) -> None:  # noqa: B027 - optional hook
        """The replica is gone: stop counting on what it held."""


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, hashes: Sequence[BlockHash], loads: Mapping[K, int]) -> K:
        replicas = sorted(loads, key=str)
        return replicas[next(self._next) % len(replicas)]


class LeastLoaded(RoutingPolicy):
    """Fewest requests in flight; ties go round the replicas so an idle cluster still spreads."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, hashes: Sequence[BlockHash], loads: Mapping[K, int]) -> K:
        replicas = sorted(loads, key=str)
        start = next(self._next) % len(replicas)
        return min(
            replicas[start:] + replicas[:start], key=loads.__getitem__
        )  # min keeps the first


class PrefixAware(RoutingPolicy):
    """The replica holding the longest known prefix, within a load bound; else the least loaded."""

    name = "prefix-aware"

    def __init__(
        self, *, load_factor: float = 1.25, slack: int = 2, max_entries: int = 1 << 20
    ) -> None:
        if load_factor < 1 or slack < 1 or max_entries < 1:
            raise ConfigError(
                "prefix-aware routing needs load_factor >= 1, slack >= 1, max_entries >= 1"
            )
        self.load_factor, self.slack, self.max_entries = load_factor, slack, max_entries
        self._owners: OrderedDict[BlockHash, dict[Hashable, None]] = OrderedDict()

    def choose(self, hashes: Sequence[BlockHash], loads: Mapping[K, int]) -> K:
        bound = self.load_factor * sum(loads.values()) / len(loads) + self.slack
        chosen = self._longest_match(hashes, loads, bound)
        if chosen is None:
            chosen = min(loads, key=lambda r: (loads[r], _spread(hashes, r)))
        self.record(hashes, chosen)
        return chosen

    def _longest_match(
        self, hashes: Sequence[BlockHash], loads: Mapping[K, int], bound: float
    ) -> K | None:
        for h in reversed(hashes):
            # the replicas recorded for h; `in loads` keeps the live ones, which are Ks
            recorded = cast("Iterable[K]", self._owners.get(h, ()))
            owners = [r for r in recorded if r in loads and loads[r] < bound]
            if owners:
                return min(owners, key=lambda r: loads[r])
        return None

    def record(self, hashes: Sequence[BlockHash], replica: Hashable) -> None:
        for h in hashes:
            owners = self._owners.setdefault(h, {})
            owners[replica] = None
            self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        for h in list(self._owners):
            owners = self._owners[h]
            owners.pop(replica, None)
            if not owners:
                del self._owners[h]

    def num_entries(self) -> int:
        return len(self._owners)


def _spread(hashes: Sequence[BlockHash], replica: Hashable) -> int:
    """Rendezvous tie-break: equal loads send a new prefix to a replica fixed by its first block."""
    return zlib.crc32((hashes[0] if hashes else b"") + str(replica).encode())


def make_policy(name: str) -> RoutingPolicy:
    """A fresh policy by its CLI name."""
    classes = {"round-robin": RoundRobin, "least-loaded": LeastLoaded, "prefix-aware": PrefixAware}
    if name not in classes:
        raise ConfigError(f"unknown routing {name!r} (use {', '.join(POLICIES)})")
    return classes[name]()

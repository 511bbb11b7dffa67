"""The Ray Serve request router in front of the engine replicas (--data-parallel-size; Ray).

It runs inside the ingress's deployment handle. Each call to a replica carries a `RouteKey`
as its first argument: the prompt's block hashes, a replica index for calls meant for one
replica (/v1/kv and /metrics ask each one), or the name of the replica that keeps a stored
response the call needs (server/response_owners.py; the hashes' choice if it is gone). The
choice itself is `pagedkv.routing`'s, the code the simulator runs; loads are this router's
own counts of requests in flight (exact, since every request goes through it). Ray removes a
dead replica from the candidates, and the policy forgets what that replica held.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedkv.kv.hashing import BlockHash
from pagedkv.routing import make_policy


@dataclass(frozen=True, slots=True)
class RouteKey:
    """What the router reads from a call: the prompt's block hashes, or one replica by index or
    by name."""

    hashes: tuple[BlockHash, ...] = ()
    replica: int | None = None  # index into the replicas sorted by id (for per-replica calls)
    owner: str | None = None  # the actor name of the replica keeping a response the call needs


class PagedKVRouter(RequestRouter):
    """Routes by a `pagedkv.routing` policy; Ray takes the next rank if a replica is full."""

    # a replica busy with a forward pass on a loaded machine answers Ray's queue probe late
    queue_len_response_deadline_s = 2.0
    max_queue_len_response_deadline_s = 10.0

    # Ray calls it with request_router_kwargs; a router names the ones it takes (Ray's own examples)
    def initialize_state(self, policy: str = "prefix-aware") -> None:  # type: ignore[override]
        self.policy = make_policy(policy)
        self.in_flight: Counter[ReplicaID] = Counter()
        self._sent: dict[str, ReplicaID] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        key: Any = pending_request.args[0] if pending_request and pending_request.args else None
        if pending_request is not None:  # else Ray retries a full or slow replica in a tight loop
            pending_request.routing_context.should_backoff = True
        # duck-typed: Serve pickles the ingress by value, so its RouteKey is a copy of this class
        if not by_id or not hasattr(key, "hashes") or not hasattr(key, "replica"):
            return [candidate_replicas]
        if key.replica is not None:
            ordered = sorted(by_id, key=lambda rid: rid.unique_id)
            return [[by_id[ordered[key.replica % len(ordered)]]]]
        owner = getattr(key, "owner", None)
        named = [rid for rid in by_id if owner is not None and rid.to_full_id_str() == owner]
        if named:
            return [[by_id[named[0]]]]
        chosen = self.policy.choose(key.hashes, {rid: self.in_flight[rid] for rid in by_id})
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id != chosen),
            key=lambda r: self.in_flight[r.replica_id],
        )
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result
    ) -> None:
        self.in_flight[replica_id] += 1
        self._sent[pending_request.metadata.internal_request_id] = replica_id
        key: Any = pending_request.args[0] if pending_request.args else None
        if getattr(key, "hashes", None) and key.replica is None and not getattr(key, "owner", None):
            # where the prefix really went (not a call sent where a response is kept)
            self.policy.record(key.hashes, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._sent.pop(internal_request_id, None) is not None and self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)
        self.in_flight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.policy.forget(replica_id)

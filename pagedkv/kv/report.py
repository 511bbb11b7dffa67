"""What the manager shows: pool counters for /metrics, the JSON snapshot behind GET /v1/kv and
the dashboard, and the full audit tests run after every operation."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.kv.table import cdiv

if TYPE_CHECKING:
    from pagedkv.kv.manager import KVCacheManager


@dataclass(slots=True)
class KVStats:
    """Pool counters for metrics and the dashboard. `tokens_held` counts each physical slot once."""

    num_blocks: int
    free: int  # free blocks, cached ones included
    cached: int  # free but still findable by prefix lookup
    used: int  # referenced by at least one request
    shared: int  # referenced by more than one request
    tokens_held: int
    token_slots: int  # used * block_size
    token_utilization: float
    usage: float
    prefix_queries: int  # tokens looked up at admission
    prefix_hits: int  # tokens served from the prefix cache
    host_blocks: int
    host_free: int
    num_requests: int
    offload_hits: int = 0  # of prefix_hits, tokens loaded from the offload tiers

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def block_fills(m: KVCacheManager) -> tuple[dict[int, int], dict[int, list[str]]]:
    """Tokens in each referenced block, and who holds it. O(total table length)."""
    fills: dict[int, int] = {}
    owners: dict[int, list[str]] = defaultdict(list)
    bs = m.block_size
    for req_id, req in m.requests.items():
        for i, block in enumerate(req.blocks):
            fill = min(bs, max(0, req.num_tokens - i * bs))
            fills[block.block_id] = max(fill, fills.get(block.block_id, 0))
            owners[block.block_id].append(req_id)
    return fills, owners


def kv_stats(m: KVCacheManager) -> KVStats:
    pool = m.pool
    free = pool.num_free
    used = m.num_blocks - free
    tokens_held = sum(block_fills(m)[0].values())
    token_slots = used * m.block_size
    return KVStats(
        num_blocks=m.num_blocks,
        free=free,
        cached=sum(1 for block in pool.cached.values() if block.ref_count == 0),
        used=used,
        shared=sum(1 for block in pool.blocks if block.ref_count > 1),
        tokens_held=tokens_held,
        token_slots=token_slots,
        token_utilization=tokens_held / token_slots if token_slots else 0.0,
        usage=used / m.num_blocks,
        prefix_queries=m.prefix_queries,
        prefix_hits=m.prefix_hits,
        host_blocks=m.num_host_blocks,
        host_free=m.host.num_free(),
        num_requests=len(m.requests),
        offload_hits=m.offload_hits,
    )


def kv_snapshot(m: KVCacheManager) -> dict:
    stats = kv_stats(m)
    fills, owners = block_fills(m)
    blocks = []
    for block in m.pool.blocks:
        bid = block.block_id
        state = "used" if block.ref_count else "cached" if block.block_hash is not None else "free"
        fill = fills.get(bid, m.block_size if state == "cached" else 0)
        blocks.append(
            {
                "id": bid,
                "state": state,
                "ref_count": block.ref_count,
                "fill": fill,
                "owners": owners.get(bid, []),
            }
        )
    requests = {
        req_id: {
            "block_table": [block.block_id for block in req.blocks],
            "num_tokens": req.num_tokens,
            "num_cached_tokens": req.num_cached,
            "swapped": req.swapped is not None,
        }
        for req_id, req in m.requests.items()
    }
    return {
        **dataclasses.asdict(stats),
        "prefix_hit_rate": stats.prefix_hit_rate,
        "block_size": m.block_size,
        "allocation_policy": m.allocation_policy,
        "prefix_caching": m.enable_prefix_caching,
        "blocks": blocks,
        "requests": requests,
    }


def check_integrity(m: KVCacheManager) -> None:
    """Pool audit, plus: each ref count equals the number of tables holding the block, tables are
    long enough, only full blocks are hashed, and no host block is lost or held twice."""
    m.pool.check_integrity()
    bs = m.block_size
    refs: Counter[int] = Counter()
    hosts: list[int] = []
    for req_id, req in m.requests.items():
        if req.swapped is not None:
            assert not req.blocks, f"{req_id}: swapped but holds device blocks"
            assert len(req.swapped) >= cdiv(req.num_tokens, bs), f"{req_id}: swapped table short"
            hosts += [b.host for b in req.swapped if b.host is not None]
            continue
        assert len(req.blocks) >= cdiv(req.num_tokens, bs), f"{req_id}: table too short"
        ids = {block.block_id for block in req.blocks}
        assert len(ids) == len(req.blocks), f"{req_id}: block twice"
        for i, block in enumerate(req.blocks):
            refs[block.block_id] += 1
            assert block.block_hash is None or i < req.num_tokens // bs, (
                f"{req_id}: block {block.block_id} at {i} is hashed but not full"
            )
    for block in m.pool.blocks:
        assert block.ref_count == refs[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, "
            f"held by {refs[block.block_id]} tables"
        )
    m.host.check_integrity(hosts)

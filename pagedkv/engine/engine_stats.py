"""What an engine reports about itself (for /metrics, the dashboard and the bench): one snapshot
of its queues, KV pool and counters, read between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    token_utilization: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    block_size: int
    token_capacity: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    offload_hits: int  # prompt tokens loaded back from the host / disk tiers
    offload_saved_blocks: int  # evicted device blocks kept in a tier
    offload_disk_writes_dropped: int = 0  # blocks the disk tier's full write queue turned away
    spec_num_drafts: int = 0  # speculative decoding (spec_decode.py): steps that drafted,
    spec_num_draft_tokens: int = 0  # tokens drafted,
    spec_num_accepted_tokens: int = 0  # and drafts accepted
    model_weight_bytes: int = 0  # resident weights (after --quantization)


def engine_stats(engine: LLMEngine) -> EngineStats:
    s = engine.kv.stats()
    sch = engine.scheduler
    offload = engine.offload.stats() if engine.offload else None
    return EngineStats(
        num_running=len(sch.running),
        num_waiting=len(sch.waiting),
        num_swapped=len(sch.swapped),
        kv_usage=s.usage,
        token_utilization=s.token_utilization,
        num_blocks=s.num_blocks,
        num_free_blocks=s.free,
        num_cached_blocks=s.cached,
        block_size=engine.kv.block_size,
        token_capacity=s.num_blocks * engine.kv.block_size,
        prefix_queries=s.prefix_queries,
        prefix_hits=s.prefix_hits,
        num_preemptions=sch.num_preemptions,
        prompt_tokens=engine.prompt_tokens_total,
        generation_tokens=engine.generation_tokens_total,
        offload_hits=s.offload_hits,
        offload_saved_blocks=offload.saved if offload else 0,
        offload_disk_writes_dropped=offload.writes_dropped if offload else 0,
        spec_num_drafts=engine.spec_stats.num_drafts,
        spec_num_draft_tokens=engine.spec_stats.num_draft_tokens,
        spec_num_accepted_tokens=engine.spec_stats.num_accepted_tokens,
        model_weight_bytes=engine.weight_bytes,
    )

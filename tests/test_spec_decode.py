"""n-gram speculative decoding: the same tokens as plain decoding (greedy and seeded), under preemption,
swap, prefix caching, forks and quantized KV; drafts never reach the prefix cache; no block leaks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.engine.sampler import Sampler
from pagedkv.engine.sequence import SequenceGroup
from pagedkv.engine.spec_decode import NgramProposer, SpeculativeConfig
from pagedkv.kv.manager import KVCacheManager

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def prompts(seed: int = 0, n: int = 8) -> list[list[int]]:
    """Token prompts with repeats, so the proposer finds matches and some drafts are accepted."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 500) for _ in range(rng.randint(2, 6))]
        out.append(
            (motif * rng.randint(2, 5) + [rng.randrange(3, 500) for _ in range(rng.randint(0, 6))])[
                :40
            ]
        )
    return out


def run(path: str, sp: SamplingParams, spec: dict | None, **options) -> tuple[list, LLM]:
    llm = LLM(path, dtype="float32", block_size=4, speculative_config=spec, **options)
    outs = llm.generate(prompts(), sp, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], llm


def check_equal(path: str, sp: SamplingParams, **options) -> LLM:
    ref, _ = run(path, sp, None, **options)
    got, llm = run(path, sp, SPEC, **options)
    assert got == ref
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert llm.engine.kv_snapshot()["used"] == 0
    return llm


def test_proposer_takes_the_longest_latest_suffix_match():
    p = NgramProposer(SpeculativeConfig(3, prompt_lookup_max=3, prompt_lookup_min=1))
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 10) == [
        7,
        1,
        2,
    ]  # latest match of [1, 2, 3]
    assert p.propose([5, 6, 7, 8, 6], 10) == [7, 8, 6]  # only the 1-gram [6] matches
    assert p.propose([1, 2, 3, 4], 10) == []
    assert p.propose([1, 2, 1, 2], 1) == [1]  # bounded by room
    assert p.propose([1, 2, 1, 2], 0) == []
    strict = NgramProposer(SpeculativeConfig(2, prompt_lookup_max=4, prompt_lookup_min=2))
    assert strict.propose([5, 6, 7, 8, 6], 10) == []  # a 1-gram is too short


@pytest.mark.parametrize(
    "bad",
    [
        '{"method": "eagle", "num_speculative_tokens": 2}',
        "[1]",
        "{bad",
        '{"num_speculative_tokens": 0}',
        '{"num_speculative_tokens": 99}',
        '{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
        '{"num_speculative_tokens": 2, "draft_model": "x"}',
        '{"num_speculative_tokens": 2, "prompt_lookup_min": "3"}',
    ],
)
def test_bad_speculative_config_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="speculative-config"):
        SpeculativeConfig.parse(bad)


@pytest.mark.parametrize(
    "given, bounds",
    [
        ({}, (5, 5)),
        ({"prompt_lookup_min": 6}, (6, 6)),
        ({"prompt_lookup_max": 3}, (3, 3)),
        ({"prompt_lookup_max": 3, "prompt_lookup_min": None}, (3, 3)),
        ({"prompt_lookup_max": 4, "prompt_lookup_min": 2}, (4, 2)),
    ],
)
def test_lookup_bounds_default_as_in_vllm(given, bounds):
    """A bound left out is the other one, both left out 5 (vLLM's rule): a config vLLM takes,
    such as prompt_lookup_min 6 alone, is not refused for a maximum nobody gave."""
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert c is not None and (c.prompt_lookup_max, c.prompt_lookup_min) == bounds


def test_greedy_equals_plain_decoding(tiny_model_dir):
    check_equal(
        tiny_model_dir,
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        num_gpu_blocks_override=256,
    )


def test_greedy_equal_under_preemption_and_swap(tiny_model_dir):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # 40 blocks of 4 tokens for 8 prompts growing to ~70 tokens: preemption all along
    llm = check_equal(tiny_model_dir, sp, num_gpu_blocks_override=40, preemption_mode="recompute")
    assert llm.engine.scheduler.num_preemptions > 0
    llm = check_equal(
        tiny_model_dir, sp, num_gpu_blocks_override=40, preemption_mode="swap", swap_space="64MiB"
    )
    assert llm.engine.scheduler.num_preemptions > 0


def test_forks_and_quantized_kv_are_unchanged(tiny_model_dir):
    check_equal(
        tiny_model_dir,
        SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True),
        num_gpu_blocks_override=256,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_kv_is_unchanged(tiny_model_dir, kv_cache_dtype):
    """Each token's K/V row is quantized on its own (kvstore/quant.py): a rejected draft's rows
    leave the accepted tokens' codes as they were. (With a scale per block, a draft that grew it
    requantized the block's earlier int8 tokens, and outputs differed.)"""
    check_equal(
        tiny_model_dir,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        num_gpu_blocks_override=256,
        kv_cache_dtype=kv_cache_dtype,
    )


def test_sampling_with_speculation_runs_clean(tiny_model_dir):
    """Sampled rows go through the same rule (see the statistical test below); here: lengths, no leak.
    (Seeded outputs may differ from plain decoding: a k+1-row forward rounds differently from k+1
    one-row steps, and a sample sitting on a CDF boundary can flip.)"""
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7, n=2, ignore_eos=True)
    got, llm = run(tiny_model_dir, sp, SPEC, num_gpu_blocks_override=40)
    assert all(len(c) == 24 for o in got for c in o)
    assert llm.engine.spec_stats.num_draft_tokens > 0
    assert llm.engine.kv_snapshot()["used"] == 0


def test_no_draft_is_hashed_into_the_prefix_cache():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(10, 17))  # 7 tokens: one full block
    hashes = kv.block_hashes(tokens)
    assert kv.allocate_slots("a", hashes, 7) == []
    tokens.append(50)  # a sampled token; drafts 51..54 follow it, outside the sequence
    hashes.update(tokens)
    assert kv.allocate_slots("a", hashes, 1, num_lookahead=4) == []
    assert len(kv.block_table("a")) == 3  # 8 held + 4 lookahead slots = 3 blocks
    assert len(hashes) == 2 and len(kv.pool.cached) == 2  # blocks of held tokens only
    assert [kv.pool.blocks[b].block_hash for b in kv.block_table("a")] == [*hashes.hashes, None]
    tokens += [51, 60]  # draft 51 accepted, 60 sampled
    hashes.update(tokens)
    kv.accept_lookahead("a", hashes, 1)
    assert len(kv.block_table("a")) == 3 and kv.num_computed_tokens("a") == 9
    assert len(kv.pool.cached) == 2  # 9 held tokens fill two blocks
    kv2 = KVCacheManager(16, 4, enable_prefix_caching=True)
    hashes2 = kv2.block_hashes(list(range(8)))
    kv2.allocate_slots("a", hashes2, 8)
    hashes2.update(list(range(9)))
    kv2.allocate_slots("a", hashes2, 1, num_lookahead=7)  # lookahead past two more blocks
    assert len(kv2.block_table("a")) == 4
    hashes2.update(list(range(10)))
    kv2.accept_lookahead("a", hashes2, 0)  # every draft rejected
    assert len(kv2.block_table("a")) == 3  # the draft-only block went back
    assert kv2.num_free_blocks() == 16 - 3


def test_rejection_rule_keeps_the_target_distribution():
    """Sampling a row and accepting the draft when they agree accepts with probability p(draft) and,
    on rejection, draws from p without the draft: the target distribution either way."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :]
    sampler = Sampler(eos_token_ids=set())
    draft, trials = 1, 4000
    group = SequenceGroup.create(
        "r", None, [0], SamplingParams(temperature=1.0, seed=3, max_tokens=8), 8
    )
    seq = group.seqs[0]
    drawn = Counter(sampler(logits, [seq], [seq.rng.random()]).token_ids[0] for _ in range(trials))
    accept = drawn[draft] / trials
    assert abs(accept - 0.3) < 0.03
    rejected = trials - drawn[draft]
    for t in (0, 2, 3):  # p(t) / (1 - p(draft)) among the rejections
        assert abs(drawn[t] / rejected - probs[t].item() / 0.7) < 0.04


def test_server_counts_drafts_in_metrics(tiny_model_dir):
    import json

    from server_process import ServerProcess

    with ServerProcess(
        tiny_model_dir,
        "--dtype",
        "float32",
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "128",
        "--speculative-config",
        json.dumps(SPEC),
    ) as srv:
        client = srv.openai()
        prompt = [int(t) for t in prompts()[0]]
        done = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert done.usage.completion_tokens == 24
        m = srv.metrics()
        assert (
            m["pagedkv:spec_decode_num_draft_tokens_total"]
            >= m["pagedkv:spec_decode_num_accepted_tokens_total"]
        )
        assert m["pagedkv:spec_decode_num_drafts_total"] > 0
        srv.wait_idle()


def test_cli_rejects_a_bad_speculative_config(tiny_model_dir, capsys):
    from pagedkv.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                tiny_model_dir,
                "--prompt",
                "hi",
                "--speculative-config",
                '{"method": "medusa"}',
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "speculative-config" in err and len(err.strip().splitlines()) == 1


def test_auto_is_the_default_and_off_turns_it_off():
    from pagedkv.config import EngineConfig
    from pagedkv.engine.spec_decode import AUTO

    assert EngineConfig(model="m").speculative_config == AUTO
    assert AUTO.auto and AUTO.disable_by_batch_size is not None
    for off in ("off", "none", "null", None):
        assert EngineConfig(model="m", speculative_config=off).speculative_config is None
    # the default never changes an output, and a quantized KV cache rounds drafts differently
    assert EngineConfig(model="m", kv_cache_dtype="int8").speculative_config is None
    explicit = EngineConfig(model="m", kv_cache_dtype="int8", speculative_config=SPEC)
    assert explicit.speculative_config is not None and not explicit.speculative_config.auto


@pytest.mark.parametrize(
    "bad",
    [
        '{"num_speculative_tokens": 2, "disable_by_batch_size": 0}',
        '{"num_speculative_tokens": 2, "disable_by_batch_size": "8"}',
    ],
)
def test_bad_disable_by_batch_size_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="disable_by_batch_size"):
        SpeculativeConfig.parse(bad)


def test_no_drafts_in_a_batch_larger_than_disable_by_batch_size(tiny_model_dir):
    # 8 sequences of equal length run together to the end: a cap of 2 never drafts, 8 does
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref, _ = run(tiny_model_dir, sp, None, num_gpu_blocks_override=256)
    capped, llm = run(
        tiny_model_dir, sp, {**SPEC, "disable_by_batch_size": 2}, num_gpu_blocks_override=256
    )
    assert capped == ref and llm.engine.spec_stats.num_drafts == 0
    free, llm = run(
        tiny_model_dir, sp, {**SPEC, "disable_by_batch_size": 8}, num_gpu_blocks_override=256
    )
    assert free == ref and llm.engine.spec_stats.num_drafts > 0


def test_disk_tier_never_gets_a_reused_block_under_a_drafts_hash(tiny_model_dir, tmp_path):
    """Blocks that accepted drafts fill are registered after their forward, so their write-through
    waits for the next step; if the block is evicted and reused in between (here: an abort, then
    a prompt taking every block), the disk got the next owner's K/V under the old hash, and a
    later request (or a restart) read it back."""
    opts = dict(dtype="float32", block_size=4, num_gpu_blocks_override=24, speculative_config=SPEC)
    llm = LLM(tiny_model_dir, kv_offload_dir=str(tmp_path), kv_offload_host_memory="64MiB", **opts)
    eng = llm.engine
    for i, prompt in enumerate(prompts(seed=1, n=8)):  # until accepted drafts fill a block
        eng.add_request(f"s{i}", prompt, SamplingParams(temperature=0, max_tokens=30))
        while f"s{i}" in eng.groups and not eng.kv._writes:
            eng.step()
        if eng.kv._writes:
            break
    assert eng.kv._writes, "no step left a write-through pending"
    drafted = list(eng.groups[f"s{i}"].seqs[0].token_ids)
    eng.abort(f"s{i}")
    eng.add_request("other", list(range(300, 380)), SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished():
        eng.step()
    eng.close()
    probe = drafted[: len(drafted) // 4 * 4] + [11, 12]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fresh = LLM(tiny_model_dir, **opts).generate([probe], sp, use_tqdm=False)[0]
    again = LLM(tiny_model_dir, kv_offload_dir=str(tmp_path), **opts)
    out = again.generate([probe], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids

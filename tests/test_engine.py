"""The engine on a tiny random-weight Llama: batching, preemption, sampling, forks, aborts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.request import ParamError

PROMPTS = [
    "The quick brown fox",
    "Paged attention keeps the KV cache in blocks. Hello world! Serving a model means holding",
    "Hi",
    "Memory is cut into fixed-size blocks handed out on demand, mapped by a block table. " * 3,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(tiny_model_dir, **options) -> LLM:
    options.setdefault("dtype", "float32")
    options.setdefault("num_gpu_blocks_override", 256)
    return LLM(tiny_model_dir, **options)


def assert_pool_clean(engine: LLMEngine) -> None:
    engine.kv.check_integrity()
    s = engine.kv.stats()
    assert s.used == 0, f"{s.used} blocks still held"
    assert not engine.scheduler.has_unfinished()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy outputs, one prompt at a time, with a roomy pool."""
    llm = make_llm(tiny_model_dir)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


def test_batch_equals_one_at_a_time(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    assert token_ids(outs) == reference
    assert all(len(t) == 24 for t in reference)
    assert_pool_clean(llm.engine)


def test_greedy_equals_transformers(tiny_model_dir, reference):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    llm = make_llm(tiny_model_dir)
    tok = llm.get_tokenizer()
    for prompt, ours in zip(PROMPTS, reference):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            gen = hf.generate(
                ids,
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                min_new_tokens=24,
            )
        assert gen[0, ids.shape[1] :].tolist() == ours


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_never_changes_outputs(tiny_model_dir, reference, mode):
    # 24 blocks of 4 tokens: far too few for four requests at once, enough for any one of them.
    llm = make_llm(
        tiny_model_dir,
        num_gpu_blocks_override=24,
        block_size=4,
        preemption_mode=mode,
        swap_space="64MiB",
        max_num_batched_tokens=32,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == reference
    assert_pool_clean(llm.engine)


def test_chunked_prefill_and_prefix_cache_keep_outputs(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=7, block_size=4)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # now served from the prefix cache
    assert token_ids(first) == reference and token_ids(again) == reference
    assert again[3].num_cached_tokens > 0
    assert again[3].num_cached_tokens % 4 == 0
    assert_pool_clean(llm.engine)


def test_no_prefix_caching_reports_no_hits(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS + PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference + reference
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert llm.engine.kv.stats().prefix_hits == 0


def test_n_samples_share_prompt_blocks(tiny_model_dir):
    llm = make_llm(tiny_model_dir, block_size=4)
    engine = llm.engine
    prompt = PROMPTS[1]
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    group = engine.add_request("fork", prompt, params)
    engine.step()  # prefill, then fork into 4 samples
    assert len(group.seqs) == 4
    n_prompt = len(group.prompt_token_ids)
    full = n_prompt // 4
    tables = [engine.kv.block_table(s.seq_id) for s in group.seqs]
    assert all(
        t[:full] == tables[0][:full] for t in tables
    )  # the prompt's full blocks are held once
    stats = engine.kv.stats()
    assert stats.shared >= full
    while engine.has_unfinished():
        engine.step()
    outs = [s.output_token_ids for s in group.seqs]
    assert all(len(o) == 8 for o in outs)
    assert len({tuple(o) for o in outs}) > 1  # different samples
    assert_pool_clean(engine)


def test_seed_gives_same_output_alone_or_in_batch(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    p = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [other, p, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {
        tuple(llm.generate(PROMPTS[0], unseeded, use_tqdm=False)[0].outputs[0].token_ids)
        for _ in range(3)
    }
    assert len(runs) > 1


def test_stop_strings_and_tokens(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir)
    tok = llm.get_tokenizer()
    full_text = tok.decode(reference[0])
    stop = full_text[5:8]
    assert stop and stop in full_text
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full_text.startswith(out.text)
    # until min_tokens are out a stop string does not end the output (as in vLLM)
    late = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=12),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(late.token_ids) >= 12 and late.token_ids == reference[0][: len(late.token_ids)]
    assert late.text.startswith(out.text + stop)
    stop_tok = reference[0][5]
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    first = reference[0].index(stop_tok)
    assert out.token_ids == reference[0][: first + 1] and out.stop_reason == stop_tok
    # the stop token's text is left out unless include_stop_str_in_output (as vLLM)
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(reference[0][:first], skip_special_tokens=True)
    shown = llm.generate(
        PROMPTS[0],
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            stop_token_ids=[stop_tok],
            include_stop_str_in_output=True,
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert shown.text == tok.decode(reference[0][: first + 1], skip_special_tokens=True)
    assert shown.text != out.text and shown.token_ids == out.token_ids
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_min_tokens_and_logprobs(tiny_model_dir, reference, mode):
    """Until min_tokens, the stop token (the greedy first token) and EOS cannot be drawn. Their
    logprobs under the default raw_logprobs are the model's: they outrank the token drawn where
    the model preferred them; processed_logprobs give them none, the token drawn ranks first."""
    llm = make_llm(tiny_model_dir, logprobs_mode=mode)
    eos = llm.get_tokenizer().eos_token_ids
    banned = {reference[0][0], *eos}
    p = SamplingParams(
        temperature=0.0, max_tokens=10, min_tokens=10, stop_token_ids=[reference[0][0]], logprobs=3
    )
    out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and not banned & set(out.token_ids)
    assert (
        len(out.logprobs) == 10
    )  # vLLM's shape: per position, token id -> Logprob(logprob, rank, decoded_token)
    for lp, t in zip(out.logprobs, out.token_ids):
        assert t in lp and lp[t].logprob <= 0 and len(lp) == 3
        above = [x for x, e in lp.items() if e.logprob > lp[t].logprob]
        if mode == "processed_logprobs":
            assert not above and not banned & set(lp)
        assert lp[t].rank == 1 + len(above) and set(above) <= banned
    first = out.logprobs[0]
    if mode == "raw_logprobs":
        assert first[reference[0][0]].rank == 1 and first[out.token_ids[0]].rank == 2
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids))
    )


def test_logprobs_modes(tiny_model_dir):
    """--logprobs-mode chooses what logprobs report, never which tokens are drawn (a seeded
    request's tokens are the same in all four). raw_logprobs (the default, as vLLM's) are the
    model's own: each drawn token's equals its prompt logprob when prompt and output are read
    again as one prompt; raw_logits are the logits, the same values less each position's
    log-sum-exp. processed_* are what the token was drawn from: with top_k 3 and temperature 0.8,
    the three most likely tokens' logits / 0.8 and -inf for the rest, and their log-softmax."""
    params = SamplingParams(
        temperature=0.8, top_k=3, seed=5, max_tokens=8, ignore_eos=True, logprobs=5
    )
    got = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        llm = make_llm(tiny_model_dir, logprobs_mode=mode)
        got[mode] = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
        if mode == "raw_logprobs":  # prompt + output read again as one prompt
            full = got[mode].prompt_token_ids + got[mode].outputs[0].token_ids
            again = SamplingParams(max_tokens=1, prompt_logprobs=0)
            reread = llm.generate({"prompt_token_ids": full}, again, use_tqdm=False)[0]
        assert_pool_clean(llm.engine)
    tokens = got["raw_logprobs"].outputs[0].token_ids
    assert all(got[m].outputs[0].token_ids == tokens for m in got)
    n = len(got["raw_logprobs"].prompt_token_ids)
    for i, t in enumerate(tokens):
        raw, logits = (got[m].outputs[0].logprobs[i] for m in ("raw_logprobs", "raw_logits"))
        scaled, probs = (
            got[m].outputs[0].logprobs[i] for m in ("processed_logits", "processed_logprobs")
        )
        again = reread.prompt_logprobs[n + i]
        assert again.token_id == t and raw[t].logprob == pytest.approx(again.logprob, abs=1e-4)
        assert set(raw) == set(logits) and all(len(x) == 5 for x in (raw, scaled, probs))
        norm = logits[t].logprob - raw[t].logprob
        assert norm > 0.5  # logits are not log-probabilities
        assert all(logits[x].logprob - raw[x].logprob == pytest.approx(norm, abs=1e-4) for x in raw)
        top3 = sorted(raw, key=lambda x: -raw[x].logprob)[:3]
        assert t in top3 and raw[t].rank == scaled[t].rank == probs[t].rank
        for shown in (scaled, probs):  # the top 5 of which two have no chance: -inf
            assert {x for x, e in shown.items() if e.logprob > float("-inf")} == set(top3)
        for x in top3:
            assert scaled[x].logprob == pytest.approx(logits[x].logprob / 0.8, abs=1e-4)
        assert sum(math.exp(probs[x].logprob) for x in top3) == pytest.approx(1.0, abs=1e-5)
        lse = math.log(sum(math.exp(scaled[x].logprob) for x in top3))
        assert probs[t].logprob == pytest.approx(scaled[t].logprob - lse, abs=1e-4)
    logits_run = got["raw_logits"]
    assert logits_run.outputs[0].cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for lp, t in zip(logits_run.outputs[0].logprobs, tokens))
    )


def test_rules_that_leave_no_token_end_the_output(tiny_model_dir):
    """allowed_token_ids [w, EOS] with min_tokens, and bad word "ww": after one w nothing may be
    drawn. The output ends there (EOS) instead of drawing a token outside the list (NaN logprob):
    each the one token the rules leave, so its processed logprob is 0."""
    llm = make_llm(tiny_model_dir, logprobs_mode="processed_logprobs")
    tok = llm.get_tokenizer()
    eos = min(tok.eos_token_ids)
    word, t = next(
        (w, t)
        for t in range(100, 4000)
        if (w := tok.decode([t])).isalpha()
        and tok.encode(w + w, add_special_tokens=False) == [t, t]
    )
    for temperature in (0.0, 1.0):
        p = SamplingParams(
            temperature=temperature,
            seed=0,
            max_tokens=6,
            min_tokens=4,
            allowed_token_ids=[t, eos],
            bad_words=[word + word],
            logprobs=0,
        )
        out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [t, eos] and out.finish_reason == "stop"
        assert [lp[x].logprob for lp, x in zip(out.logprobs, out.token_ids)] == [0.0, 0.0]
    assert_pool_clean(llm.engine)


def test_penalties_change_output(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(PROMPTS[3], plain, use_tqdm=False)[0]
    seen = set(ref.prompt_token_ids)
    assert seen & set(ref.outputs[0].token_ids) or len(set(ref.outputs[0].token_ids)) < 24
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1e4)
    out = llm.generate(PROMPTS[3], p, use_tqdm=False)[0].outputs[0].token_ids
    assert not seen & set(out) and len(set(out)) == len(out)  # nothing seen before is repeated
    p = SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )
    out = llm.generate(PROMPTS[3], p, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(out)) >= len(set(ref.outputs[0].token_ids))


def test_fcfs_order(tiny_model_dir):
    llm = make_llm(tiny_model_dir, max_num_seqs=1)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    firsts = [o.metrics.first_token_time for o in outs]
    assert firsts == sorted(firsts)
    assert_pool_clean(llm.engine)


def test_request_larger_than_pool_is_rejected(tiny_model_dir, reference):
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=8, block_size=4)  # 32 tokens
    engine = llm.engine
    with pytest.raises(ConfigError, match="KV pool"):
        engine.add_request("big", PROMPTS[3], SamplingParams(max_tokens=8))
    assert not engine.has_unfinished()
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == reference[0][:8]
    assert_pool_clean(engine)


@pytest.mark.parametrize(
    "bad",
    [
        dict(prompt=[[]], msg="empty"),
        dict(prompt=[10**9], msg="vocabulary"),
        dict(prompt="x", max_tokens=10**6, msg="max_model_len"),
    ],
)
def test_bad_requests_leave_nothing_behind(tiny_model_dir, bad):
    llm = make_llm(tiny_model_dir)
    with pytest.raises(ConfigError, match=bad["msg"]):
        llm.generate(
            bad["prompt"], SamplingParams(max_tokens=bad.get("max_tokens", 4)), use_tqdm=False
        )
    assert not llm.engine.has_unfinished()
    assert_pool_clean(llm.engine)


def test_abort_returns_every_block(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(
            f"r{i}", p, SamplingParams(n=2 if i == 1 else 1, max_tokens=50, ignore_eos=True)
        )
    for _ in range(3):
        engine.step()
    assert engine.kv.stats().used > 0
    engine.add_request("never-run", "an abandoned prompt", SamplingParams(max_tokens=5))
    for i in [*range(len(PROMPTS)), "never-run"]:
        out = engine.abort(f"r{i}" if isinstance(i, int) else i)
        assert out.finished and all(
            c.finish_reason in ("abort", "length", "stop") for c in out.outputs
        )
    assert_pool_clean(engine)
    # /metrics' prompt_tokens_total, as vLLM's: the prompts prefilled, not one abandoned before
    assert engine.prompt_tokens_total == sum(len(engine.tokenize(p)) for p in PROMPTS)


@pytest.mark.parametrize("policy", ["reserve-max", "reserve-output"])
def test_reservation_policies_keep_outputs(tiny_model_dir, reference, policy):
    llm = make_llm(
        tiny_model_dir,
        allocation_policy=policy,
        max_model_len=256,
        num_gpu_blocks_override=64,
        block_size=16,
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert_pool_clean(llm.engine)


def test_chat(tiny_model_dir):
    llm = make_llm(tiny_model_dir)
    out = llm.chat(
        [{"role": "user", "content": "Hello"}],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_option_is_rejected(tiny_model_dir):
    with pytest.raises(ConfigError, match="unknown option"):
        LLM(tiny_model_dir, block_sise=16)


def test_cpu_engine_keeps_freed_memory_for_reuse():
    """glibc takes the setting (the machine this runs on is glibc Linux); a second call is harmless."""
    import platform

    from pagedkv.cpu_memory import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() and keep_freed_memory()


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt(tiny_model_dir, reference):
    """vLLM's cache_salt (SamplingParams, or a prompt dict's key): the cache serves a prompt's
    blocks only to requests with the same salt, and the outputs stay the same."""
    llm = make_llm(tiny_model_dir, block_size=4)
    prompt = PROMPTS[3]
    ids = llm.get_tokenizer().encode(prompt)

    def cached(salt: str | None) -> int:
        params = dataclasses.replace(GREEDY, cache_salt=salt)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference[3]
        return out.num_cached_tokens

    assert cached(None) == 0
    assert cached("tenant-a") == 0 and cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) > 0
    by_dict = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, GREEDY)[0]
    assert by_dict.num_cached_tokens > 0 and by_dict.outputs[0].token_ids == reference[3]
    with pytest.raises(ParamError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")
    assert_pool_clean(llm.engine)


def run_to_end(engine: LLMEngine) -> list[str]:
    """Step until done; the request ids in the order they finished."""
    done = []
    while engine.has_unfinished():
        done += [out.request_id for out in engine.step() if out.finished]
    return done


def test_the_priority_policy_orders_the_queue(tiny_model_dir, reference):
    """--scheduling-policy priority (vLLM's): lower priority values first, then arrival."""
    llm = make_llm(tiny_model_dir, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    for i, priority in enumerate((5, 0, 5, -1)):
        params = dataclasses.replace(GREEDY, priority=priority)
        llm.engine.add_request(f"r{i}", PROMPTS[i], params)
    assert run_to_end(llm.engine) == ["r3", "r1", "r0", "r2"]  # one at a time: in rank order
    ranked = llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[3, 2, 1, 0])
    assert token_ids(ranked) == reference  # in input order, whatever ran first
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "high"), ("priority", "low")])
def test_the_priority_policy_preempts_the_lowest_rank(tiny_model_dir, reference, policy, victim):
    """A low-priority request admitted first, a high-priority one after it: when the pool runs
    dry, first come first served preempts the later one, the priority policy the lower one."""
    llm = make_llm(
        tiny_model_dir, block_size=4, num_gpu_blocks_override=14, scheduling_policy=policy
    )
    engine = llm.engine
    low = 0 if policy == "fcfs" else 7
    engine.add_request("low", PROMPTS[1], dataclasses.replace(GREEDY, priority=low))
    engine.step()  # "low" is admitted and prefilled alone
    engine.add_request("high", PROMPTS[0], GREEDY)
    preempted = None
    results = {}
    while engine.has_unfinished():
        before = engine.scheduler.num_preemptions
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if preempted is None and engine.scheduler.num_preemptions > before:
            preempted = {s.group.request_id for s in engine.scheduler.waiting}
    assert preempted == {victim}
    assert results == {"low": reference[1], "high": reference[0]}
    with pytest.raises(ParamError, match="--scheduling-policy priority"):
        make_llm(tiny_model_dir).generate("Hi", dataclasses.replace(GREEDY, priority=1))
    assert_pool_clean(engine)

"""Beam search: the beams of transformers' own beam search on the same weights, each beam's
cumulative logprob the model's, EOS and length_penalty as vLLM scores them, the same answer
offline, through AsyncLLMEngine and over HTTP, and what cannot shape beams refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch
from server_process import TINY_SERVER, ServerProcess

from pagedkv import LLM, SamplingParams
from pagedkv.config import ConfigError
from pagedkv.engine.beam_search import BeamSearchParams, Candidates, answer, choose
from pagedkv.engine.sequence import SequenceGroup

PROMPTS = [[5, 9, 23, 7, 81, 3], [40, 2, 2, 19], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks_override=256, block_size=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)


def hf_beams(hf, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """transformers' beam search, no EOS: every beam runs max_tokens, ranked by logprob."""
    out = hf.generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
        max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0, early_stopping=False,
    )  # fmt: skip
    return [row[len(prompt) :].tolist() for row in out]


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The model's log-probabilities at each output position [len(output), vocab]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        return hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)


def test_beams_equal_transformers_beam_search(llm, hf):
    """Without EOS every beam has the same length, so vLLM's scores and transformers' rank alike:
    the same beams in the same order, each with the model's logprob of its tokens."""
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        got = [o.token_ids for o in out.outputs]
        assert got == hf_beams(hf, prompt, 3, 8)
        assert len({tuple(g) for g in got}) == 3  # three different beams
        for o in out.outputs:
            assert o.finish_reason == "length"
            logp = hf_logprobs(hf, prompt, o.token_ids)
            model = sum(float(logp[i, t]) for i, t in enumerate(o.token_ids))
            assert o.cumulative_logprob == pytest.approx(model, abs=1e-3)
    llm.engine.kv.check_integrity()
    assert not llm.engine.has_unfinished()


def test_beams_logprobs_are_the_models(llm, hf):
    """logprobs=k: each beam's tokens with their logprobs and the k most likely at each step,
    following the beam through its forks."""
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=6, ignore_eos=True, logprobs=2)
    plain = SamplingParams(n=3, use_beam_search=True, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    (ref,) = llm.generate([PROMPTS[1]], plain, use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    for o in out.outputs:
        logp = hf_logprobs(hf, PROMPTS[1], o.token_ids)
        assert len(o.logprobs) == len(o.token_ids)
        for i, (token, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            assert entry[token].logprob == pytest.approx(float(logp[i, token]), abs=1e-3)
            assert set(logp[i].topk(2).indices.tolist()) <= set(entry)
        total = sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs))
        assert total == pytest.approx(o.cumulative_logprob, abs=1e-4)


def test_beams_show_logits_in_a_logits_mode(tiny_model_dir, hf):
    """--logprobs-mode raw_logits: the same beams, ranked by their logprobs as ever, each step
    shown with the model's logits (as transformers computes them) instead."""
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=4, ignore_eos=True, logprobs=2)
    llm = LLM(
        tiny_model_dir, dtype="float32", num_gpu_blocks_override=64, logprobs_mode="raw_logits"
    )
    (ref,) = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks_override=64).generate(
        [PROMPTS[1]], params, use_tqdm=False
    )
    (out,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
    for o, r in zip(out.outputs, ref.outputs):
        assert o.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-5)
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[1] + o.token_ids])).logits[
                0, len(PROMPTS[1]) - 1 : -1
            ]
        for i, entry in enumerate(o.logprobs):
            assert len(entry) >= 2 and set(entry) == set(r.logprobs[i])
            for token, e in entry.items():
                assert e.logprob == pytest.approx(float(logits[i, token]), abs=1e-3)
                assert e.rank == r.logprobs[i][token].rank


def test_beam_search_api_and_mixed_generate(llm):
    """LLM.beam_search (vLLM's shapes: tokens and text hold the prompt) answers as generate does,
    and generate runs beam-search and sampled prompts of one call each their own way."""
    width = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    (beam,) = llm.beam_search([PROMPTS[0]], width)
    (ref,) = llm.generate([PROMPTS[0]], width.sampling_params(), use_tqdm=False)
    assert [s.tokens for s in beam.sequences] == [PROMPTS[0] + o.token_ids for o in ref.outputs]
    tok = llm.get_tokenizer()
    assert beam.sequences[0].text == tok.decode(beam.sequences[0].tokens)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS[:2], [width.sampling_params(), greedy], use_tqdm=False)
    assert [o.token_ids for o in mixed[0].outputs] == [o.token_ids for o in ref.outputs]
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("include_eos", [False, True])
def test_eos_ends_a_beam_and_length_penalty_weighs_lengths(include_eos):
    """A candidate ending in EOS is set aside as ended ("stop"), its length not counting the
    EOS; the others go on. length_penalty decides between a short ended beam and longer live
    ones (scores: logprob / (prompt + output) ** length_penalty, as vLLM's)."""
    eos = 99

    def run(penalty: float) -> list:
        params = SamplingParams(n=2, use_beam_search=True, max_tokens=3, length_penalty=penalty,
                                include_stop_str_in_output=include_eos)  # fmt: skip
        group = SequenceGroup.create("r", None, [1, 2], params, 3)
        state, live = group.beam, group.seqs

        def step(tops: list[dict[int, float]]) -> list:
            children = []
            candidates = [Candidates(seq, top) for seq, top in zip(live, tops)]
            for c in choose(state, params, candidates, {eos}):
                child = group.new_seq(len(children), [*c.parent.token_ids, c.token])
                child.cum_logprob = c.cum_logprob
                children.append(child)
            return children

        live = step([{eos: -1.1, 5: -1.2, 6: -1.3, 7: -9.0}])
        assert [s.output_token_ids for s in live] == [[5], [6]]  # EOS left the live beams
        for _ in range(2):
            live = step([{8: -0.5, 9: -3.0}, {8: -0.6, 9: -3.0}])
        answer(state, params, live, lambda t: "")
        return state.outputs

    # penalty 1: ended -1.1 / 2 = -0.55, live -2.2 / 5 = -0.44 and -2.5 / 5 = -0.5: live win
    assert [o.token_ids for o in run(1.0)] == [[5, 8, 8], [6, 8, 8]]
    # penalty 0: raw logprobs, the short ended beam wins
    first = run(0.0)[0]
    assert first.token_ids == ([eos] if include_eos else [])
    assert (first.finish_reason, first.stop_reason, first.cumulative_logprob) == ("stop", eos, -1.1)


def test_beams_share_their_blocks_and_survive_preemption(llm, tiny_model_dir):
    """Forked beams hold their common blocks once (copy-on-write); a pool too small for every
    running sequence preempts beams as a search, by recompute or swap, never changing them."""
    prompt = list(range(100, 140))  # 10 blocks of 4 tokens
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    engine.add_request("shared", prompt, params)
    for _ in range(4):
        engine.step()
    beams = [s for s in engine.groups["shared"].seqs if not s.finished]
    assert len(beams) == 4
    # 10 prompt blocks and at most 2 more a beam: 44 if each beam held its own
    assert engine.kv.snapshot()["used"] <= 10 + 2 * 4
    while engine.has_unfinished():
        engine.step()
    engine.kv.check_integrity()

    # three searches and a sampled request beside them, whose victims may be beams or not
    prompts = [PROMPTS[0], PROMPTS[2], prompt[:20], PROMPTS[1]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plist = [params, params, params, greedy]
    want = [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, plist, False)]
    for mode, policy in (("recompute", "fcfs"), ("swap", "fcfs"), ("recompute", "priority")):
        small = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks_override=16,
                    block_size=4, preemption_mode=mode, swap_space="64MiB",
                    max_num_batched_tokens=16, scheduling_policy=policy)  # fmt: skip
        got = [[o.token_ids for o in r.outputs] for r in small.generate(prompts, plist, False)]
        assert small.engine.scheduler.num_preemptions > 0, mode
        assert got == want, (mode, policy)
        small.engine.kv.check_integrity()
        small.close()


def test_what_would_shape_beams_is_refused(llm):
    for field, value in [("top_p", 0.5), ("stop", ["x"]), ("logit_bias", {1: 2.0}), ("seed", 3),
                         ("repetition_penalty", 1.2), ("min_tokens", 2)]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"{field} cannot be combined with use_beam_search"):
            SamplingParams(n=2, use_beam_search=True, **{field: value})
    with pytest.raises(ConfigError, match="length_penalty applies to beam search only"):
        SamplingParams(length_penalty=0.8)
    with pytest.raises(ConfigError, match="n=300 takes the 600 most likely tokens"):
        llm.generate([PROMPTS[0]], SamplingParams(n=300, use_beam_search=True), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_async_engine_and_server_answer_as_offline(llm, tiny_model_dir):
    from pagedkv import AsyncEngineArgs, AsyncLLMEngine

    params = SamplingParams(n=2, use_beam_search=True, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs]

    async def main() -> list[list[int]]:
        args = AsyncEngineArgs(model=tiny_model_dir, dtype="float32", block_size=4)
        engine = AsyncLLMEngine.from_engine_args(args)
        outs = [out async for out in engine.generate(PROMPTS[2], params, "b1")]
        # a search given up mid-way (its client gone) leaves no request and no block behind
        long = SamplingParams(n=3, use_beam_search=True, max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(anext(engine.generate(PROMPTS[0], long, "b2")))
        await asyncio.sleep(0.5)
        task.cancel()
        inner = engine._llm.engine
        for _ in range(100):
            if not inner.has_unfinished():
                break
            await asyncio.sleep(0.05)
        assert not inner.has_unfinished()
        inner.kv.check_integrity()
        await engine.shutdown()
        assert len(outs) == 1 and outs[0].finished
        return [o.token_ids for o in outs[0].outputs]

    assert asyncio.run(main()) == want
    tok = llm.get_tokenizer()
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "n": 2, "use_beam_search": True,
            "ignore_eos": True}  # fmt: skip
    with ServerProcess(tiny_model_dir, *TINY_SERVER, "--dtype", "float32") as srv:
        r = srv.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [tok.decode(w) for w in want]
        r = srv.http.post("/v1/completions", json={**body, "logprobs": 2})
        assert [len(c["logprobs"]["tokens"]) for c in r.json()["choices"]] == [6, 6], r.text
        r = srv.http.post("/v1/completions", json={**body, "top_p": 0.5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
        r = srv.http.post("/v1/completions", json={**body, "n": 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
                "use_beam_search": True, "stream": True}  # fmt: skip
        r = srv.http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        assert srv.http.get("/health").status_code == 200


def test_beams_under_tensor_parallelism_and_an_adapter(llm, tiny_model_dir, tmp_path):
    """Forks are block copies every rank makes: -tp 2 gives -tp 1's beams; an adapter's beams
    run under it (and differ from the base model's)."""
    from test_lora import make_adapter

    from pagedkv import LoRARequest

    params = SamplingParams(n=3, use_beam_search=True, max_tokens=6, ignore_eos=True)
    want = [[o.token_ids for o in r.outputs] for r in llm.generate(PROMPTS, params, False)]
    tp = LLM(tiny_model_dir, dtype="float32", tensor_parallel_size=2, enable_lora=True,
             num_gpu_blocks_override=256, block_size=4)  # fmt: skip
    try:
        assert [
            [o.token_ids for o in r.outputs] for r in tp.generate(PROMPTS, params, False)
        ] == want
        adapter = LoRARequest("a", 1, make_adapter(tmp_path / "a", tiny_model_dir, seed=5))
        under = tp.generate(PROMPTS, params, False, lora_request=adapter)
        alone = [tp.generate([p], params, False, lora_request=adapter)[0] for p in PROMPTS[:1]]
        assert [o.token_ids for o in under[0].outputs] == [o.token_ids for o in alone[0].outputs]
        assert [[o.token_ids for o in r.outputs] for r in under] != want
        tp.engine.kv.check_integrity()
    finally:
        tp.close()

"""Embeddings (engine/pooling.py, /v1/embeddings): a prompt's final hidden states pooled into one
vector, equal to transformers' own last_hidden_state pooled the same way, whatever the engine
did on the way (chunked prefill, batching, preemption, prefix-cache hits), with no block left
behind; and served to the real openai client."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from server_process import TINY_SERVER, ServerProcess
from tiny_model import make_tiny_model

from pagedkv.engine.chat import render_chat
from pagedkv.engine.llm import LLM
from pagedkv.engine.pooling import Pooler, PoolingParams
from pagedkv.engine.request import ParamError, SamplingParams

PROMPTS = [[5, 17, 33, 90, 4, 7] * k for k in (1, 3, 9)] + [[11, 12]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("emb") / "qwen3", arch="qwen3", tie=True)


def hf_hidden(folder: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def sentence_transformers_folder(src: str, dst, mode: str, normalize: bool) -> str:
    """The model as a sentence-transformers folder whose Pooling module pools `mode`."""
    shutil.copytree(src, dst)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    flags = {
        "pooling_mode_mean_tokens": False,
        "pooling_mode_cls_token": False,
        "pooling_mode_lasttoken": False,
    }
    flags[mode] = True
    (dst / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **flags})
    )
    return str(dst)


def close(got: list, want: torch.Tensor) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-4)


def test_last_token_pooling_equals_transformers_through_chunks_batches_and_the_prefix_cache(qwen3):
    """A causal LM's default: the last prompt token's hidden state, unit length. Prompts up to 54
    tokens in chunks of 16, four at a time; then again, from the prefix cache."""
    ref = [torch.nn.functional.normalize(h[-1], dim=0) for h in hf_hidden(qwen3, PROMPTS)]
    llm = LLM(qwen3, dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.pooler == Pooler("LAST", True)
    kv = llm.engine.scheduler.kv
    total = kv.num_free_blocks()
    for _ in range(2):
        outs = llm.embed(PROMPTS, use_tqdm=False)
        for out, want, prompt in zip(outs, ref, PROMPTS):
            close(out.outputs.embedding, want)
            assert out.prompt_token_ids == prompt
        assert kv.num_free_blocks() == total  # (cached blocks count as free)
    again = llm.generate(PROMPTS, llm.engine.pooler.request_params(64), use_tqdm=False)
    assert again[2].num_cached_tokens == 52  # all but the last block, which is computed again
    close(torch.nn.functional.normalize(again[2].pooled, dim=0).tolist(), ref[2])


@pytest.mark.parametrize("task", [None, "token_embed"])
def test_beside_generation_and_preempted_nothing_changes(qwen3, task):
    """An embedding request in a 16-block pool beside a growing generation: preempted and
    recomputed, it pools each position once (its vector equals transformers'; a per-token
    task's rows too, one a token), and the generation's tokens equal those it makes alone."""
    rows = hf_hidden(qwen3, PROMPTS[2:3])[0]
    ref = rows if task else torch.nn.functional.normalize(rows[-1], dim=0)
    llm = LLM(
        qwen3,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=16,
        speculative_config="off",  # the generation grows a token a step
    )
    gen = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], gen, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("gen", PROMPTS[0], gen)
    for _ in range(24):  # the generation holds 8 blocks, and grows
        engine.step()
    engine.add_request("embed", PROMPTS[2], engine.pooler.request_params(64, task=task))  # 14
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    assert engine.scheduler.num_preemptions > 0
    assert done["gen"].outputs[0].token_ids == alone and done["gen"].pooled is None
    pooled = done["embed"].pooled
    close((pooled if task else torch.nn.functional.normalize(pooled, dim=0)).tolist(), ref)
    assert llm.engine.scheduler.kv.num_free_blocks() == 16


@pytest.mark.parametrize(
    "mode, normalize",
    [
        ("pooling_mode_mean_tokens", True),
        ("pooling_mode_cls_token", False),
        ("pooling_mode_lasttoken", False),
    ],
)
def test_a_sentence_transformers_folder_sets_the_pooling(qwen3, tmp_path, mode, normalize):
    """MEAN and CLS need every position, so they skip the prefix cache (a second run computes the
    whole prompt again and gives the same vectors); Normalize only where the folder has it."""
    folder = sentence_transformers_folder(qwen3, tmp_path / "st", mode, normalize)
    hidden = hf_hidden(folder, PROMPTS)
    pool = {
        "pooling_mode_mean_tokens": lambda h: h.mean(0),
        "pooling_mode_cls_token": lambda h: h[0],
    }
    ref = [pool.get(mode, lambda h: h[-1])(h) for h in hidden]
    if normalize:
        ref = [torch.nn.functional.normalize(r, dim=0) for r in ref]
    llm = LLM(folder, dtype="float32", block_size=4, max_num_batched_tokens=16)
    for _ in range(2):
        for out, want in zip(llm.embed(PROMPTS, use_tqdm=False), ref):
            close(out.outputs.embedding, want)
    norms = [
        torch.tensor(o.outputs.embedding).norm().item() for o in llm.embed(PROMPTS, use_tqdm=False)
    ]
    assert all(abs(n - 1) < 1e-5 for n in norms) == normalize


def test_dimensions_truncate_then_normalize_and_bad_ones_are_refused(qwen3):
    llm = LLM(qwen3, dtype="float32", block_size=4)
    full = llm.embed(PROMPTS[:1], use_tqdm=False, pooling_params=PoolingParams(normalize=False))
    raw = torch.tensor(full[0].outputs.embedding)
    short = llm.embed(PROMPTS[:1], use_tqdm=False, pooling_params=PoolingParams(dimensions=8))
    close(short[0].outputs.embedding, torch.nn.functional.normalize(raw[:8], dim=0))
    for bad in (0, 65):
        with pytest.raises(ParamError, match="dimensions must be from 1 to the model.s 64"):
            llm.embed(PROMPTS[:1], use_tqdm=False, pooling_params=PoolingParams(dimensions=bad))
    with pytest.raises(ParamError, match="pooling must be one of"):
        SamplingParams(pooling="MAX")


def test_a_broken_pooling_module_is_refused_by_name(qwen3, tmp_path):
    folder = sentence_transformers_folder(qwen3, tmp_path / "st", "pooling_mode_mean_tokens", True)
    config = tmp_path / "st" / "1_Pooling" / "config.json"
    config.write_text(
        json.dumps(
            {
                "pooling_mode_mean_tokens": True,
                "pooling_mode_max_tokens": False,
                "pooling_mode_cls_token": True,
            }
        )
    )
    from pagedkv.config import ConfigError

    with pytest.raises(
        ConfigError,
        match="st: its Pooling module asks for pooling_mode_mean_tokens, pooling_mode_cls_token; "
        "pagedkv pools one of LAST, MEAN, CLS$",
    ):
        Pooler.of_model(folder)
    config.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="asks for pooling_mode_max_tokens; pagedkv pools one of"):
        Pooler.of_model(folder)
    config.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read its sentence-transformers modules"):
        Pooler.of_model(folder)


def test_the_server_answers_the_openai_client(qwen3):
    """The openai client asks for base64 by default; floats on request; the same vectors as
    LLM.embed; vLLM's chat form (messages rendered by the template, no generation prompt) as the
    rendered text's tokens. Bad input: OpenAI-shaped 400s and 404s, and no block kept."""
    llm = LLM(qwen3, dtype="float32", block_size=4)
    offline = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = render_chat(llm.engine.tokenizer, messages, add_generation_prompt=False)
    ids = llm.engine.tokenize(rendered, add_special_tokens=False)
    by_chat = llm.embed([ids], use_tqdm=False)[0].outputs.embedding
    with ServerProcess(qwen3, *TINY_SERVER, "--dtype", "float32") as server:
        client = server.openai(api_key="none")
        r = client.embeddings.create(model="tiny", input=PROMPTS)
        assert [d.index for d in r.data] == list(range(len(PROMPTS)))
        for d, want in zip(r.data, offline):
            close(d.embedding, torch.tensor(want))
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, PROMPTS))
        text = client.embeddings.create(model="tiny", input="hello world", encoding_format="float")
        one = client.embeddings.create(model="tiny", input=["hello world"], dimensions=8)
        assert len(text.data[0].embedding) == 64 and len(one.data[0].embedding) == 8
        close(
            one.data[0].embedding,
            torch.nn.functional.normalize(torch.tensor(text.data[0].embedding[:8]), dim=0),
        )
        url = f"{server.url}/v1/embeddings"
        chat = httpx.post(url, json={"messages": messages}, timeout=60).json()
        close(chat["data"][0]["embedding"], torch.tensor(by_chat))
        assert chat["usage"]["prompt_tokens"] == len(ids)
        for body, status, param in [
            ({"model": "tiny", "input": "x", "messages": messages}, 400, None),
            ({"model": "tiny", "input": []}, 400, "input"),
            ({"model": "tiny", "input": "x", "dimensions": 65}, 400, "dimensions"),
            ({"model": "tiny", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
            ({"model": "tiny", "input": [[1, 2, 10**6]]}, 400, None),
            ({"model": "tiny", "input": [[1] * 5000]}, 400, None),
            ({"model": "other", "input": "x"}, 404, "model"),
        ]:
            reply = httpx.post(url, json=body, timeout=60)
            assert reply.status_code == status, (body, reply.text)
            error = reply.json()["error"]
            assert error["message"] and (param is None or error["param"] == param), error
        server.wait_idle()
        metrics = server.metrics()
        assert metrics["pagedkv:kv_cache_free_blocks"] == 512
        # one success a prompt: the 4 + 1 + 1 + 1 inputs of the four answers above
        assert metrics["pagedkv:request_success_total"] == len(PROMPTS) + 3
        assert metrics["pagedkv:request_prompt_tokens_count"] == len(PROMPTS) + 3
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}


def base_model_folder(tmp_path) -> str:
    """A tiny Qwen3 saved as transformers' base model, as Qwen3-Embedding ships: flat names
    (embed_tokens, layers, norm), no LM head, and tie_word_embeddings false."""
    src = make_tiny_model(tmp_path / "causal", arch="qwen3")
    base = transformers.AutoModel.from_pretrained(src, dtype=torch.float32)
    base.save_pretrained(tmp_path / "base")
    shutil.copy(f"{src}/tokenizer.json", tmp_path / "base")
    return str(tmp_path / "base")


def test_a_base_model_checkpoint_makes_embeddings_only(tmp_path):
    folder = base_model_folder(tmp_path)
    assert not json.loads((tmp_path / "base" / "config.json").read_text())["tie_word_embeddings"]
    ref = [torch.nn.functional.normalize(h[-1], dim=0) for h in hf_hidden(folder, PROMPTS)]
    llm = LLM(folder, dtype="float32", block_size=4)
    for out, want in zip(llm.embed(PROMPTS, use_tqdm=False), ref):
        close(out.outputs.embedding, want)
    from pagedkv.config import ConfigError

    with pytest.raises(ConfigError, match="makes embeddings only .the checkpoint has no LM head"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="--runner generate: the checkpoint has no LM head"):
        LLM(folder, dtype="float32", runner="generate")


@pytest.mark.parametrize("runner", ["pooling", "generate"])
def test_the_runner_flag_limits_what_a_server_makes(qwen3, runner):
    """vLLM's --runner: pooling refuses text, generate refuses embeddings, each with a 400 that
    says so; the other endpoint works."""
    with ServerProcess(qwen3, *TINY_SERVER, "--dtype", "float32", "--runner", runner) as server:
        client = server.openai(api_key="none")
        text = httpx.post(
            f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=60
        )
        vectors = httpx.post(
            f"{server.url}/v1/embeddings", json={"model": "tiny", "input": "hi"}, timeout=60
        )
        refused, served = (text, vectors) if runner == "pooling" else (vectors, text)
        assert served.status_code == 200, served.text
        assert refused.status_code == 400
        want = (
            "makes embeddings only (--runner pooling)"
            if runner == "pooling"
            else "makes no embeddings or scores (--runner generate)"
        )
        assert want in refused.json()["error"]["message"]
        if runner == "pooling":
            assert len(client.embeddings.create(model="tiny", input=["a", "b"]).data) == 2
        server.wait_idle()


def test_a_gguf_declares_its_pooling(qwen3, tmp_path):
    """llama.cpp's {arch}.pooling_type: mean here, pooled as transformers' mean and unit length
    (llama.cpp's server normalizes too); a reranker's (rank) is refused by name."""
    import gguf
    from test_loaders import hf_to_gguf

    from pagedkv.config import ConfigError

    def pooling(kind):
        return lambda w: w.add_pooling_type(kind)

    path = hf_to_gguf(Path(qwen3), tmp_path / "mean.gguf", extra=pooling(gguf.PoolingType.MEAN))
    llm = LLM(str(path), dtype="float32", block_size=4)
    assert llm.engine.pooler == Pooler("MEAN", True)
    ref = [torch.nn.functional.normalize(h.mean(0), dim=0) for h in hf_hidden(qwen3, PROMPTS)]
    for out, want in zip(llm.embed(PROMPTS, use_tqdm=False), ref):
        close(out.outputs.embedding, want)
    rank = hf_to_gguf(Path(qwen3), tmp_path / "rank.gguf", extra=pooling(gguf.PoolingType.RANK))
    with pytest.raises(ConfigError, match="rerankers .4. are not supported"):
        LLM(str(rank), dtype="float32")


def test_tensor_parallelism_gives_the_same_embeddings(qwen3):
    """-tp 2: rank 0 pools the hidden rows its all-reduce made, equal to one process's."""
    one = LLM(qwen3, dtype="float32", block_size=4).embed(PROMPTS, use_tqdm=False)
    llm = LLM(qwen3, dtype="float32", block_size=4, tensor_parallel_size=2)
    try:
        two = llm.embed(PROMPTS, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(one, two):
        close(b.outputs.embedding, torch.tensor(a.outputs.embedding))


def test_the_pooler_config_overrides_the_models_pooling(qwen3):
    """vLLM's --pooler-config: mean pooling, not scaled, over the model's last-token default;
    --convert embed is --runner pooling; mistakes are one line, exit 2, before the load."""
    from server_process import serve_error

    from pagedkv.config import ConfigError

    config = {"pooling_type": "mean", "normalize": False}
    llm = LLM(qwen3, dtype="float32", block_size=4, pooler_config=config, convert="embed")
    assert llm.engine.pooler == Pooler("MEAN", False) and llm.engine.config.runner == "pooling"
    for out, hidden in zip(llm.embed(PROMPTS, use_tqdm=False), hf_hidden(qwen3, PROMPTS)):
        close(out.outputs.embedding, hidden.mean(0))
    for bad, message in [
        ({"pooling_type": "MAX"}, "pooling_type must be one of LAST, MEAN, CLS"),
        ({"softmax": True}, "--pooler-config: softmax not supported"),
        ({"normalize": "yes"}, "normalize must be true or false"),
        ("[1]", "--pooler-config must be a JSON object"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LLM(qwen3, dtype="float32", pooler_config=bad)
    assert serve_error(qwen3, "--pooler-config", "{nope") == [
        "pagedkv serve: error: --pooler-config is not JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    ]
    lines = serve_error(qwen3, "--convert", "embed", "--runner", "generate")
    assert lines[-1].endswith("--convert embed makes embeddings: not --runner generate")

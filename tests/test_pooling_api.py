"""vLLM's generic pooling API: LLM.encode, AsyncLLMEngine.encode and POST /pooling make each
prompt's pooled vector into its task's output ("embed" as LLM.embed and /v1/embeddings make it,
"classify" as LLM.classify and /classify do; by default the model's own task), and each prompt
token's own hidden state into the same for the per-token tasks ("token_embed", equal to
transformers' rows, through chunks and the prefix cache; "token_classify"; preempted:
test_embeddings.py), refuse what
pagedkv does not make by name, and leave no block behind."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch
from server_process import TINY_SERVER, ServerProcess
from test_embeddings import hf_hidden
from test_scoring import seq_cls_folder
from tiny_model import make_tiny_model

from pagedkv import AsyncEngineArgs, AsyncLLMEngine, PoolingRequestOutput
from pagedkv.config import ConfigError
from pagedkv.engine.llm import LLM
from pagedkv.engine.pooling import PoolingParams
from pagedkv.engine.request import ParamError

PROMPTS = [[5, 17, 33, 90, 4, 7] * k for k in (1, 3)] + ["a short text"]
TEXTS = ["what a lovely day", "the train was late again"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("pool") / "qwen3", arch="qwen3", tie=True)


@pytest.fixture(scope="module")
def classifier(qwen3, tmp_path_factory) -> str:
    return seq_cls_folder(qwen3, tmp_path_factory.mktemp("pool") / "cls", num_labels=3)


def close(got, want) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=2e-5, rtol=1e-4)


def no_block_left(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks() == kv.num_blocks


def test_encode_makes_what_embed_and_classify_make(qwen3, classifier):
    llm = LLM(qwen3, dtype="float32", block_size=4)
    embedded = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    for task in (None, "embed"):
        outs = llm.encode(PROMPTS, pooling_task=task, use_tqdm=False)
        assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in outs)
        assert [o.prompt_token_ids for o in outs[:2]] == PROMPTS[:2]
        for o, want in zip(outs, embedded):
            assert o.outputs.data.dtype == torch.float32 and o.outputs.data.shape == (64,)
            close(o.outputs.data.tolist(), want)
    short = llm.encode(PROMPTS, PoolingParams(dimensions=8, task="embed"), use_tqdm=False)
    for o, want in zip(short, embedded):
        close(
            o.outputs.data.tolist(),
            torch.nn.functional.normalize(torch.tensor(want[:8]), dim=0).tolist(),
        )
    for task, error, match in [
        ("plugin", ParamError, "'plugin' is not supported: pagedkv has no plugins"),
        ("rerank", ParamError, "'rerank': one of embed, classify, token_embed, token_classify"),
        ("classify", ConfigError, "this model has no classifier"),
        ("token_classify", ConfigError, "this model has no classifier"),
    ]:
        with pytest.raises(error, match=match):
            llm.encode(PROMPTS, pooling_task=task, use_tqdm=False)
    no_block_left(llm)

    labels = LLM(classifier, dtype="float32", block_size=4)
    probs = [o.outputs.probs for o in labels.classify(TEXTS, use_tqdm=False)]
    for o, want in zip(labels.encode(TEXTS, use_tqdm=False), probs):  # the model's task: classify
        assert o.outputs.data.shape == (3,) and abs(float(o.outputs.data.sum()) - 1) < 1e-5
        close(o.outputs.data.tolist(), want)
    logits = labels.encode(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    for o, want in zip(logits, probs):
        close(torch.softmax(o.outputs.data, 0).tolist(), want)
    with pytest.raises(ParamError, match="classify takes only use_activation") as e:
        labels.encode(TEXTS, PoolingParams(dimensions=2), use_tqdm=False)
    assert e.value.param == "dimensions"
    for task in ("embed", "token_embed"):
        with pytest.raises(ConfigError, match="is a classifier"):
            labels.encode(TEXTS, pooling_task=task, use_tqdm=False)
    no_block_left(labels)


LONG = [5, 17, 33, 90, 4, 7] * 9  # 54 tokens: 14 blocks of 4


def test_per_token_tasks_give_each_prompt_tokens_own_output(qwen3, classifier):
    """token_embed: every prompt token's hidden state, equal to transformers' rows, in chunks of
    16 and with the prompt's blocks in the prefix cache (all its positions computed again);
    token_classify: the classifier's labels for every token, its last row what classify gives."""
    prompts = [*PROMPTS[:2], LONG]
    rows = hf_hidden(qwen3, prompts)
    llm = LLM(qwen3, dtype="float32", block_size=4, max_num_batched_tokens=16)
    llm.embed(prompts, use_tqdm=False)  # their blocks now in the prefix cache
    outs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
    for o, want, prompt in zip(outs, rows, prompts):
        assert o.outputs.data.shape == (len(prompt), 64) and o.num_cached_tokens == 0
        close(o.outputs.data, torch.nn.functional.normalize(want, dim=-1))
    raw = llm.encode(prompts, PoolingParams(8, normalize=False, task="token_embed"), use_tqdm=False)
    for o, want in zip(raw, rows):
        close(o.outputs.data, want[:, :8])
    last = llm.embed(prompts, use_tqdm=False)
    for o, e in zip(outs, last):
        close(o.outputs.data[-1], e.outputs.embedding)
    no_block_left(llm)

    labels = LLM(classifier, dtype="float32", block_size=4)
    probs = [o.outputs.probs for o in labels.classify(TEXTS, use_tqdm=False)]
    per_token = labels.encode(TEXTS, pooling_task="token_classify", use_tqdm=False)
    logits = labels.encode(
        TEXTS, PoolingParams(use_activation=False, task="token_classify"), use_tqdm=False
    )
    for o, lo, want in zip(per_token, logits, probs):
        n = len(o.prompt_token_ids)
        assert o.outputs.data.shape == (n, 3) and n > 1
        close(o.outputs.data.sum(1), torch.ones(n))
        close(o.outputs.data[-1], want)
        close(torch.softmax(lo.outputs.data, -1), o.outputs.data)
    with pytest.raises(ParamError, match="token_classify takes only use_activation"):
        labels.encode(TEXTS, PoolingParams(dimensions=2, task="token_classify"), use_tqdm=False)
    no_block_left(labels)


def test_the_async_engine_encodes_as_offline(qwen3):
    want = LLM(qwen3, dtype="float32", block_size=4).embed(["hello world"], use_tqdm=False)
    rows = torch.nn.functional.normalize(hf_hidden(qwen3, [LONG])[0], dim=-1)

    async def main() -> list[PoolingRequestOutput]:
        args = AsyncEngineArgs(model=qwen3, dtype="float32", block_size=4)
        engine = AsyncLLMEngine.from_engine_args(args)
        try:
            outs = [o async for o in engine.encode("hello world", PoolingParams(), "e1")]
            tokens = [o async for o in engine.encode(LONG, PoolingParams(task="token_embed"), "t")]
            assert len(tokens) == 1 and tokens[0].finished
            close(tokens[0].outputs.data, rows)
            with pytest.raises(ConfigError, match="this model has no classifier"):
                await anext(engine.encode("hi", PoolingParams(task="classify"), "e2"))
            with pytest.raises(TypeError, match="pooling_params must be a pagedkv PoolingParams"):
                await anext(engine.encode("hi", {"task": "embed"}, "e3"))  # type: ignore[arg-type]
            inner = engine._llm.engine
            assert not inner.has_unfinished()
            inner.kv.check_integrity()
            return outs
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished and outs[0].request_id == "e1"
    close(outs[0].outputs.data.tolist(), want[0].outputs.embedding)


def pool(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/pooling", json={"model": "tiny", **body}, timeout=60)


def test_the_pooling_endpoint_answers_as_the_task_endpoints(qwen3, classifier):
    with ServerProcess(qwen3, *TINY_SERVER, "--dtype", "float32") as server:
        embedded = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"model": "tiny", "input": TEXTS, "encoding_format": "float"},
            timeout=60,
        ).json()["data"]
        for task in (None, "embed"):
            got = pool(server, {"input": TEXTS, "task": task}).json()
            assert got["object"] == "list" and got["id"].startswith("pool-")
            assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0
            for d, want in zip(got["data"], embedded):
                assert d["object"] == "pooling"
                close(d["data"], want["embedding"])
        b64 = pool(server, {"input": TEXTS[:1], "encoding_format": "base64"}).json()
        raw = np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4").copy()
        close(raw.tolist(), embedded[0]["embedding"])
        chat = pool(server, {"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and len(chat.json()["data"][0]["data"]) == 64
        ids = [5, 17, 33, 90, 4, 7]
        rows = pool(server, {"input": [ids, TEXTS[0]], "task": "token_embed"}).json()
        assert rows["usage"]["prompt_tokens"] == len(ids) + len(rows["data"][1]["data"])
        want = torch.nn.functional.normalize(hf_hidden(qwen3, [ids])[0], dim=-1)
        close(rows["data"][0]["data"], want)  # a list of floats a token
        close(rows["data"][1]["data"][-1], embedded[0]["embedding"])
        flat = pool(server, {"input": [ids], "task": "token_embed", "encoding_format": "base64"})
        raw = np.frombuffer(base64.b64decode(flat.json()["data"][0]["data"]), dtype="<f4").copy()
        close(raw.reshape(len(ids), 64), want)  # the rows one after another
        for body, status, param, words in [
            ({"input": "x", "task": "plugin"}, 400, "task", "pagedkv has no plugins"),
            ({"input": "x", "task": "token_classify"}, 400, None, "has no classifier"),
            ({"input": "x", "task": "classify"}, 400, None, "has no classifier"),
            ({"input": "x", "dimensions": 65}, 400, "dimensions", "from 1 to the model's 64"),
            ({"input": "x", "model": "other"}, 404, "model", "other"),
        ]:
            reply = pool(server, body)
            assert reply.status_code == status, reply.text
            error = reply.json()["error"]
            assert words in error["message"] and (param is None or error["param"] == param), error
        server.wait_idle()
        assert server.metrics()["pagedkv:kv_cache_free_blocks"] == 512
        assert httpx.get(f"{server.url}/load", timeout=60).json() == {"server_load": 0}

    with ServerProcess(classifier, *TINY_SERVER, "--dtype", "float32") as server:
        labelled = httpx.post(
            f"{server.url}/classify", json={"model": "tiny", "input": TEXTS}, timeout=60
        ).json()["data"]
        for body in ({"input": TEXTS}, {"input": TEXTS, "task": "classify"}):
            got = pool(server, body).json()["data"]
            for d, want in zip(got, labelled):
                close(d["data"], want["probs"])
        logits = pool(server, {"input": TEXTS, "use_activation": False}).json()["data"]
        for d, want in zip(logits, labelled):
            close(torch.softmax(torch.tensor(d["data"]), 0).tolist(), want["probs"])
        per_token = pool(server, {"input": TEXTS, "task": "token_classify"}).json()["data"]
        for d, want in zip(per_token, labelled):
            assert len(d["data"]) > 1 and all(len(row) == 3 for row in d["data"])
            close(d["data"][-1], want["probs"])
        for task in ("embed", "token_embed"):
            refused = pool(server, {"input": "x", "task": task})
            assert refused.status_code == 400 and "is a classifier" in refused.text
        dims = pool(server, {"input": "x", "dimensions": 2})
        assert dims.status_code == 400 and dims.json()["error"]["param"] == "dimensions"
        server.wait_idle()
        assert server.metrics()["pagedkv:kv_cache_free_blocks"] == 512

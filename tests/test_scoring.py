"""Scores of text pairs (engine/scoring.py; /score, /rerank, LLM.score): an embedding model's
cosine, equal to the cosine of transformers' hidden states; a causal LM made a reranker by vLLM's
--hf-overrides, equal to transformers' softmax over the two tokens' logits (or the one token's
sigmoid); the classifier's rows read back from every form the LM head is kept in; a classifier's
labels (/classify, LLM.classify) equal to transformers'; and the server's endpoints, their
errors, and no block left behind."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import transformers
from safetensors.torch import load_file
from server_process import TINY_SERVER, ServerProcess, serve_error
from tiny_model import make_tiny_model

from pagedkv.config import ConfigError
from pagedkv.engine.chat import render_chat
from pagedkv.engine.llm import LLM
from pagedkv.engine.pooling import PoolingParams
from pagedkv.engine.request import ParamError, SamplingParams
from pagedkv.server.middleware import IGNORED_HEADER

QUERY = "what is the capital of France"
DOCS = ["Paris is the capital of France.", "Berlin is in Germany.", "the cat sat on the mat"]
# Qwen3-Reranker's prompt, as vLLM's example template writes it (shortened)
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements. "
    'Answer only "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: '
    "{{ instruction | default('Given a web search query, retrieve relevant passages') }}\n"
    "<Query>: {{ messages[0]['content'] }}\n<Document>: {{ messages[1]['content'] }}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("score") / "qwen3", arch="qwen3", tie=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("score") / "untied", arch="qwen3")


def tokens(folder: str, *ids: int) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    return [tok.id_to_token(i) for i in ids]


def reranker(folder: str, **kwargs) -> LLM:
    no, yes = tokens(folder, 100, 200)
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True,
    }
    return LLM(folder, hf_overrides=overrides, block_size=4, **{"dtype": "float32", **kwargs})


def hf_logits(folder: str, texts: list[str]) -> list[torch.Tensor]:
    """transformers' logits at each text's last token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([tok.encode(t).ids])).logits[0, -1] for t in texts]


def test_an_embedding_model_scores_by_cosine(qwen3):
    """A bi-encoder: each text embedded once (the query once for all its documents), each pair
    scored by the cosine of transformers' last hidden states; 1:N and N:N alike."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{qwen3}/tokenizer.json")
    model = transformers.AutoModel.from_pretrained(qwen3, dtype=torch.float32)

    def hidden(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tok.encode(text).ids])).last_hidden_state[0, -1]

    llm = LLM(qwen3, dtype="float32", block_size=4, num_gpu_blocks_override=64)
    got = llm.score(QUERY, DOCS, use_tqdm=False)
    want = [torch.cosine_similarity(hidden(QUERY), hidden(d), dim=0).item() for d in DOCS]
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-5)
    assert got[0].prompt_token_ids == tok.encode(QUERY).ids + tok.encode(DOCS[0]).ids
    pairs = llm.score(DOCS[:2], DOCS[1:], use_tqdm=False)
    want = [
        torch.cosine_similarity(hidden(a), hidden(b), dim=0).item() for a, b in [DOCS[:2], DOCS[1:]]
    ]
    assert [o.outputs.score for o in pairs] == pytest.approx(want, abs=1e-5)
    assert llm.score("same text", "same text", use_tqdm=False)[0].outputs.score == pytest.approx(
        1.0
    )
    with pytest.raises(ParamError, match="pairs are one against many .1:N. or one to one"):
        llm.score(DOCS[:2], DOCS, use_tqdm=False)
    with pytest.raises(ParamError, match="data_2 must hold at least one text"):
        llm.score(QUERY, [], use_tqdm=False)
    with pytest.raises(ParamError, match="a score template is for a cross-encoder"):
        llm.score(QUERY, DOCS, use_tqdm=False, chat_template=TEMPLATE)
    assert llm.engine.scheduler.kv.num_free_blocks() == 64
    # (vLLM's newer use_activation is an embedding's normalize)
    raw = llm.embed(QUERY, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    assert raw[0].outputs.embedding == pytest.approx(hidden(QUERY).tolist(), abs=1e-5)


def test_a_causal_lm_made_a_reranker_equals_transformers(qwen3):
    """vLLM's --hf-overrides for the original Qwen3-Reranker: the pair as one prompt, scored
    by the softmax of the "yes" token's logit against the "no" one's at its last token; with a
    score template (roles query and document, an instruction); without the sigmoid, the logit
    difference. The prompts of one query share their first blocks: the prefix cache serves them."""
    llm = reranker(qwen3, num_gpu_blocks_override=64)
    assert llm.engine.generates is False
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    logits = hf_logits(qwen3, [QUERY + d for d in DOCS])
    want = [torch.softmax(lg[[100, 200]], 0)[1].item() for lg in logits]
    assert got == pytest.approx(want, abs=1e-5)
    raw = llm.score(QUERY, DOCS, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    assert [o.outputs.score for o in raw] == pytest.approx(
        [(lg[200] - lg[100]).item() for lg in logits], abs=1e-4
    )
    # a score template, and an instruction passed to it
    kv = llm.engine.scheduler.kv
    templated = llm.score(
        QUERY,
        DOCS,
        use_tqdm=False,
        chat_template=TEMPLATE,
        tokenization_kwargs={"truncate_prompt_tokens": 500},
    )
    from jinja2 import Template

    texts = [Template(TEMPLATE).render(messages=[{"content": QUERY}, {"content": d}]) for d in DOCS]
    want = [torch.softmax(lg[[100, 200]], 0)[1].item() for lg in hf_logits(qwen3, texts)]
    assert [o.outputs.score for o in templated] == pytest.approx(want, abs=1e-5)
    assert kv.num_free_blocks() == 64
    # generation and embeddings are refused, each saying why
    with pytest.raises(ConfigError, match="is a classifier only .--hf-overrides"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="is a classifier .--hf-overrides.* no embeddings"):
        llm.embed("hi", use_tqdm=False)


def test_one_tokens_logit_and_the_checkpoint_forms_of_the_head(untied):
    """method no_post_processing (bge-reranker-v2-gemma's): the sigmoid of one token's logit.
    The classifier's rows equal the checkpoint's lm_head rows in every form the head is kept:
    float32 panels, bfloat16 prepacked, int8."""
    yes = tokens(untied, 300)
    overrides = {"classifier_from_token": yes, "method": "no_post_processing"}
    llm = LLM(untied, dtype="float32", block_size=4, hf_overrides=overrides)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    want = [torch.sigmoid(lg[300]).item() for lg in hf_logits(untied, [QUERY + d for d in DOCS])]
    assert got == pytest.approx(want, abs=1e-5)
    head = load_file(f"{untied}/model.safetensors")["lm_head.weight"]
    assert torch.equal(llm.engine.classifier.rows[0], head[300].float())
    bf16 = LLM(untied, dtype="bfloat16", block_size=4, hf_overrides=overrides)
    assert torch.equal(bf16.engine.classifier.rows[0], head[300].to(torch.bfloat16).float())
    int8 = LLM(untied, dtype="bfloat16", quantization="int8", block_size=4, hf_overrides=overrides)
    lm_head = int8.engine.loaded.model.lm_head
    assert torch.equal(int8.engine.classifier.rows[0], lm_head.dequantize()[300])


def seq_cls_folder(src: str, dst, num_labels: int = 1, **config) -> str:
    """The model as a *ForSequenceClassification checkpoint (the "seq-cls" conversions of LLM
    rerankers ship so): its backbone and a score head, no LM head. `config`: more of its
    config's fields (id2label, problem_type)."""
    import shutil

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        src, num_labels=num_labels, dtype=torch.float32, **config
    )
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (the chat template is in the second)
        shutil.copy(f"{src}/{name}", dst)
    return str(dst)


def test_a_checkpoint_with_its_own_score_head(qwen3, tmp_path):
    """Qwen3ForSequenceClassification as saved: the sigmoid of score.weight times the last
    token's hidden state, equal to transformers'; it refuses text; more than one label, or
    --hf-overrides over it, is refused by name."""
    from tokenizers import Tokenizer

    folder = seq_cls_folder(qwen3, tmp_path / "seqcls")
    llm = LLM(folder, dtype="float32", block_size=4)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        want = [
            torch.sigmoid(model(torch.tensor([tok.encode(QUERY + d).ids])).logits[0, 0]).item()
            for d in DOCS
        ]
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ConfigError, match="is a classifier only .a \\*ForSequenceClass"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="checkpoint makes a classifier.*: not --runner generate"):
        LLM(folder, dtype="float32", runner="generate")
    overrides = {"classifier_from_token": tokens(qwen3, 5), "method": "no_post_processing"}
    with pytest.raises(ConfigError, match="a score head of its own"):
        LLM(folder, dtype="float32", hf_overrides=overrides)


def test_a_score_head_with_a_bias(qwen3, tmp_path):
    """A *ForSequenceClassification checkpoint whose score head has a bias (score.bias): each
    label's logit is its row times the last hidden state plus its bias, as a biased nn.Linear
    gives; a bias of the wrong shape is refused by name."""
    from safetensors.torch import load_file, save_file

    folder = seq_cls_folder(qwen3, tmp_path / "biased", num_labels=3)
    texts = [QUERY, *DOCS]
    plain = hf_classifier_logits(folder, texts)
    weights = load_file(f"{folder}/model.safetensors")
    bias = torch.tensor([0.5, -1.0, 2.0])
    save_file({**weights, "score.bias": bias}, f"{folder}/model.safetensors")
    llm = LLM(folder, dtype="float32", block_size=4)
    got = llm.classify(texts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor([o.outputs.probs for o in got]), plain + bias, atol=1e-5, rtol=1e-4
    )
    save_file({**weights, "score.bias": bias[:2]}, f"{folder}/model.safetensors")
    with pytest.raises(ConfigError, match=r"weight score.bias has shape \(2,\), expected \(3,\)"):
        LLM(folder, dtype="float32")


def hf_classifier_logits(folder: str, texts: list[str]) -> torch.Tensor:
    """transformers' classifier logits, a row per text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        return torch.cat([model(torch.tensor([tok.encode(t).ids])).logits for t in texts])


def test_a_classifier_of_many_labels_equals_transformers(qwen3, tmp_path):
    """LLM.classify: the softmax over transformers' logits (a sigmoid each where the labels are
    independent; the logits without use_activation), the labels named as id2label names them;
    such a classifier scores no pairs, generates nothing and makes no embeddings, each said so;
    an embedding model has no classifier to classify with."""
    names = {0: "negative", 1: "neutral", 2: "positive"}
    folder = seq_cls_folder(qwen3, tmp_path / "three", num_labels=3, id2label=names)
    llm = LLM(folder, dtype="float32", block_size=4)
    texts = [QUERY, *DOCS, "x"]
    logits = hf_classifier_logits(folder, texts)
    outs = llm.classify(texts, use_tqdm=False)
    assert [o.outputs.num_classes for o in outs] == [3] * len(texts)
    for o, want in zip(outs, torch.softmax(logits, 1)):
        assert o.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)
    assert [o.prompt_token_ids for o in outs] == [llm.engine.tokenize(t) for t in texts]
    assert llm.engine.classifier.labels == ("negative", "neutral", "positive")
    raw = llm.classify(texts, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    assert [o.outputs.probs for o in raw] == [pytest.approx(r, abs=1e-5) for r in logits.tolist()]
    with pytest.raises(ConfigError, match="has 3 labels and scores no pairs.*/classify"):
        llm.score(QUERY, DOCS, use_tqdm=False)
    with pytest.raises(ConfigError, match="is a classifier only"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ConfigError, match="makes no embeddings"):
        llm.embed("hi", use_tqdm=False)
    with pytest.raises(ParamError, match="classify takes only use_activation"):
        llm.classify("hi", use_tqdm=False, pooling_params=PoolingParams(dimensions=2))
    assert llm.engine.scheduler.kv.num_free_blocks() == llm.engine.scheduler.kv.num_blocks
    multi = seq_cls_folder(
        qwen3, tmp_path / "multi", num_labels=2, problem_type="multi_label_classification"
    )
    got = [o.outputs.probs for o in LLM(multi, dtype="float32").classify(DOCS, use_tqdm=False)]
    want = torch.sigmoid(hf_classifier_logits(multi, DOCS)).tolist()
    assert got == [pytest.approx(w, abs=1e-5) for w in want]
    with pytest.raises(ConfigError, match="no classifier to classify with"):
        LLM(qwen3, dtype="float32").classify("hi", use_tqdm=False)


def test_tensor_parallelism_gives_the_same_scores(qwen3):
    """-tp 2: rank 0 holds the whole LM head, so the classifier and its scores are one
    process's."""
    one = [o.outputs.score for o in reranker(qwen3).score(QUERY, DOCS, use_tqdm=False)]
    llm = reranker(qwen3, tensor_parallel_size=2)
    try:
        two = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    finally:
        llm.close()
    assert two == pytest.approx(one, abs=1e-5)


def test_the_prepacked_forms_give_back_their_rows():
    """PrepackedWeight.rows: every form this machine packs, rows across panel edges."""
    from pagedkv.model.prepacked import PrepackedWeight

    ran = 0
    for kind, dtype in [
        ("pairs", torch.bfloat16),
        ("panels", torch.float32),
        ("onednn", torch.bfloat16),
    ]:
        for n in (100, 33):
            w = torch.randn(n, 64).to(dtype)
            try:
                packed = PrepackedWeight.of(w, kind)
            except Exception:  # (a form this CPU or build does not have)
                continue
            ids = [0, 5, 31, 32, n - 1]
            assert torch.equal(packed.rows(ids), w[ids].float()), (kind, n)
            ran += 1
    assert ran >= 2  # (every x86 build packs pairs or oneDNN's, and panels)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_theta": 1.0}, "--hf-overrides: rope_theta not supported"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "needs classifier_from_token"),
        ({"classifier_from_token": ["a", "b"]}, "method must be from_2_way_softmax"),
        (
            {"classifier_from_token": ["a"], "method": "from_2_way_softmax"},
            "from_2_way_softmax takes 2 token",
        ),
        (
            {"classifier_from_token": ["a"], "is_original_qwen3_reranker": "yes"},
            "is_original_qwen3_reranker must be true or false",
        ),
        (
            {
                "classifier_from_token": ["a"],
                "method": "no_post_processing",
                "architectures": ["Qwen3ForCausalLM"],
            },
            "architectures may only name a \\*ForSequenceClassification .a reranker., not "
            "Qwen3ForCausalLM",
        ),
        (
            {"classifier_from_token": ["not-a-token!"], "method": "no_post_processing"},
            "'not-a-token!' is not a token of this model's vocabulary",
        ),
    ],
)
def test_bad_overrides_are_refused_by_name(qwen3, overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLM(qwen3, dtype="float32", hf_overrides=overrides)


def test_bad_overrides_on_the_command_line(qwen3):
    assert serve_error(qwen3, "--hf-overrides", "[1]") == [
        "pagedkv serve: error: --hf-overrides must be a JSON object, e.g. "
        '\'{"classifier_from_token": ["no", "yes"]}\''
    ]
    over = json.dumps({"classifier_from_token": ["a", "b"], "method": "from_2_way_softmax"})
    lines = serve_error(qwen3, "--hf-overrides", over, "--runner", "generate")
    assert lines[-1] == (
        "pagedkv serve: error: --hf-overrides makes a classifier, which scores pairs by its last "
        "token: not --runner generate"
    )


def test_the_server_scores_and_reranks(qwen3):
    """/score (its four request shapes, /v1/score too) and /rerank (/v1, /v2): the offline
    scores, sorted for rerank and cut to top_n; OpenAI-shaped 400s naming the field; an
    embedding server's cosines; no block left, and one success a text in /metrics."""
    no, yes = tokens(qwen3, 100, 200)
    over = json.dumps({"classifier_from_token": [no, yes], "is_original_qwen3_reranker": True})
    offline = [o.outputs.score for o in reranker(qwen3).score(QUERY, DOCS, use_tqdm=False)]
    with ServerProcess(qwen3, *TINY_SERVER, "--dtype", "float32", "--hf-overrides", over) as server:
        for path, body in [
            ("/score", {"text_1": QUERY, "text_2": DOCS}),
            ("/v1/score", {"queries": [QUERY], "documents": DOCS}),
            ("/score", {"queries": QUERY, "items": DOCS, "model": "tiny"}),
            ("/score", {"data_1": [QUERY] * 3, "data_2": DOCS}),
        ]:
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 200, server.output()[-3000:]
            answer = r.json()
            assert answer["object"] == "list" and answer["id"].startswith("score-")
            assert [d["index"] for d in answer["data"]] == [0, 1, 2]
            assert [d["score"] for d in answer["data"]] == pytest.approx(offline, abs=1e-5)
            assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
        order = sorted(range(3), key=lambda i: -offline[i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = httpx.post(
                server.url + path, json={"query": QUERY, "documents": DOCS, "top_n": 2}, timeout=60
            )
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == order[:2]
            assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order[:2]]
            assert [x["relevance_score"] for x in results] == pytest.approx(
                [offline[i] for i in order[:2]], abs=1e-5
            )
        every = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCS}).json()
        assert len(every["results"]) == 3
        bare = httpx.post(
            server.url + "/rerank",
            json={"query": QUERY, "documents": DOCS, "return_documents": False},
        ).json()["results"]
        assert [set(x) for x in bare] == [{"index", "relevance_score"}] * 3
        for path, body, param in [
            ("/score", {"text_1": DOCS[:2], "text_2": DOCS}, "text_1"),
            ("/score", {"text_1": QUERY}, None),
            ("/score", {"text_1": QUERY, "documents": DOCS}, None),
            ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
            ("/score", {"text_1": QUERY, "text_2": [{"content": []}]}, "text_2"),
            ("/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 5}, None),
            ("/rerank", {"query": QUERY, "documents": DOCS, "truncation_side": "up"}, None),
            ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
            ("/rerank", {"query": QUERY, "documents": DOCS, "instruction": "x"}, None),
            ("/rerank", {"query": QUERY, "documents": DOCS, "model": "other"}, "model"),
            ("/v1/embeddings", {"input": "hi"}, None),
            ("/v1/completions", {"prompt": "hi"}, None),
        ]:
            r = httpx.post(server.url + path, json=body, timeout=60)
            status = 404 if body.get("model") == "other" else 400
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert error["message"] and (param is None or error["param"] == param), error
        # no template: an instruction has nowhere to go, said so
        said = httpx.post(
            server.url + "/rerank", json={"query": QUERY, "documents": DOCS, "instruction": "x"}
        ).json()["error"]["message"]
        assert "need a score template (--chat-template)" in said
        server.wait_idle()
        metrics = server.metrics()
        assert metrics["pagedkv:kv_cache_free_blocks"] == 512
        assert metrics["pagedkv:request_success_total"] == 4 * 3 + 3 * 3 + 3 + 3
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    # an embedding model's server: cosines, the query embedded once
    offline = [
        o.outputs.score for o in LLM(qwen3, dtype="float32").score(QUERY, DOCS, use_tqdm=False)
    ]
    with ServerProcess(qwen3, *TINY_SERVER, "--dtype", "float32") as server:
        r = httpx.post(server.url + "/classify", json={"input": QUERY}, timeout=60)
        assert r.status_code == 400 and "no classifier" in r.json()["error"]["message"], r.text
        r = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
        results = sorted(r.json()["results"], key=lambda x: x["index"])
        assert [x["relevance_score"] for x in results] == pytest.approx(offline, abs=1e-5)
        server.wait_idle()
        assert server.metrics()["pagedkv:request_success_total"] == 1 + len(DOCS)


def test_the_server_classifies(qwen3, tmp_path):
    """/classify and /v1/classify: the offline probabilities (texts and token ids), the likeliest
    label's name, vLLM's answer shape; OpenAI-shaped 400s naming the field; /score refused on a
    classifier of three labels; no block left, and one success an input in /metrics."""
    names = {0: "negative", 1: "neutral", 2: "positive"}
    folder = seq_cls_folder(qwen3, tmp_path / "three", num_labels=3, id2label=names)
    llm = LLM(folder, dtype="float32")
    offline = [o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)]
    ids = llm.engine.tokenize(QUERY)
    by_ids = llm.classify([ids], use_tqdm=False)[0].outputs.probs
    # vLLM's chat form: the conversation rendered by the template, no generation prompt, no
    # special tokens of the tokenizer's own
    messages = [{"role": "user", "content": QUERY}, {"role": "assistant", "content": DOCS[0]}]
    rendered = render_chat(llm.engine.tokenizer, messages, add_generation_prompt=False)
    chat_ids = llm.engine.tokenize(rendered, add_special_tokens=False)
    by_chat = llm.classify([chat_ids], use_tqdm=False)[0].outputs.probs
    with ServerProcess(folder, *TINY_SERVER, "--dtype", "float32") as server:
        for path, body, want in [
            ("/classify", {"input": DOCS}, offline),
            ("/v1/classify", {"input": DOCS[0], "model": "tiny"}, offline[:1]),
            ("/classify", {"input": ids}, [by_ids]),
            ("/classify", {"input": [ids, DOCS[1]]}, [by_ids, offline[1]]),
            ("/classify", {"messages": messages}, [by_chat]),
        ]:
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 200, server.output()[-3000:]
            answer = r.json()
            assert answer["object"] == "list" and answer["id"].startswith("classify-")
            assert [d["index"] for d in answer["data"]] == list(range(len(want)))
            for d, probs in zip(answer["data"], want):
                assert d["probs"] == pytest.approx(probs, abs=1e-5)
                assert d["num_classes"] == 3
                assert d["label"] == names[max(range(3), key=probs.__getitem__)]
            usage = answer["usage"]
            assert usage["prompt_tokens"] == usage["total_tokens"] > 0
            assert usage["completion_tokens"] == 0
        raw = httpx.post(server.url + "/classify", json={"input": DOCS[0], "use_activation": False})
        assert sum(raw.json()["data"][0]["probs"]) != pytest.approx(1.0)
        # a field nothing reads is named in the answer's header, as everywhere
        named = httpx.post(server.url + "/classify", json={"input": "hi", "dimensions": 2})
        assert named.status_code == 200 and "dimensions" in named.headers[IGNORED_HEADER]
        for path, body, param in [
            ("/classify", {"input": []}, "input"),
            ("/classify", {"input": ""}, "input"),
            ("/classify", {}, None),
            ("/classify", {"input": "hi", "messages": messages}, None),
            ("/classify", {"messages": []}, "messages"),
            ("/classify", {"messages": messages, "chat_template": "{{ 1 }}"}, "chat_template"),
            ("/classify", {"input": "hi", "truncate_prompt_tokens": "x"}, "truncate_prompt_tokens"),
            ("/classify", {"input": [[10**9]]}, None),
            ("/classify", {"input": "hi", "model": "other"}, "model"),
            ("/score", {"text_1": QUERY, "text_2": DOCS}, None),
            ("/v1/embeddings", {"input": "hi"}, None),
        ]:
            r = httpx.post(server.url + path, json=body, timeout=60)
            status = 404 if body.get("model") == "other" else 400
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert error["message"] and (param is None or error["param"] == param), error
        said = httpx.post(server.url + "/score", json={"text_1": QUERY, "text_2": DOCS}).json()
        assert "scores no pairs" in said["error"]["message"]
        server.wait_idle()
        metrics = server.metrics()
        assert metrics["pagedkv:kv_cache_free_blocks"] == 512
        assert metrics["pagedkv:request_success_total"] == 3 + 1 + 1 + 2 + 1 + 1 + 1
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}

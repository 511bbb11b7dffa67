"""Encoders (model/encoder.py): BERT, XLM-RoBERTa, DistilBERT, ModernBERT and EmbeddingGemma
embedding models, whose every token sees its whole prompt. Their embeddings equal transformers'
own hidden states pooled as the folder says (CLS by default, MEAN from sentence-transformers
modules), batched and one prompt a step alike, with no block left; what an encoder cannot do is
refused by name; served to the openai client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from server_process import TINY_SERVER, ServerProcess
from test_embeddings import sentence_transformers_folder
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pagedkv.config import ConfigError
from pagedkv.engine.llm import LLM
from pagedkv.engine.pooling import Pooler
from pagedkv.engine.request import ParamError, SamplingParams

WORDS = "the a cat dog sat on mat ran fast slow big small red blue and or not".split()
TEXTS = [
    "the cat sat on the mat",
    "a big red dog ran fast and the small blue cat sat",
    "the dog sat on the mat",  # (as long as the first: a batch of one length)
    "cat",
    "the slow cat and the fast dog ran on the big red mat or not " * 3,
]
SPECIAL = {
    "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "distilbert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],  # (pad 1: positions from 2)
}


# the test models' width: 4 heads of 16, an MLP of 96
TINY = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96)


def randomize(model: torch.nn.Module, seed: int, only: tuple[str, ...] = ("",)) -> None:
    """Every weight whose name starts as `only` says random (norms' weights about 1), so that
    none can be misplaced unseen."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(only):
                p.normal_(1.0 if name.lower().endswith("norm.weight") else 0.0, 0.3)


def encoder_folder(folder: Path, model_type: str = "bert", **config) -> str:
    """A random encoder of two layers and its WordPiece tokenizer ([CLS] text [SEP], or <s> text
    </s>); every weight random, the norms' too, so that none can be misplaced unseen."""
    special = SPECIAL[model_type]
    bert = model_type != "xlm-roberta"  # (DistilBERT's tokenizer is BERT's)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = special + WORDS + letters + ["##" + c for c in letters]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token=special[1]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = (special[2], special[3]) if bert else (special[0], special[2])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",  # (a pair: BERT's second text of type 1, RoBERTa's of type 0)
        pair=f"{cls} $A {sep} $B:1 {sep}:1" if bert else f"{cls} $A {sep} {sep} $B {sep}",
        special_tokens=[(cls, vocab.index(cls)), (sep, vocab.index(sep))],
    )
    tok.decoder = decoders.WordPiece()
    tok.enable_truncation(8)  # (a trainer's leftover: the engine must not cut prompts quietly)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    shape = dict(vocab_size=len(vocab), num_hidden_layers=2, max_position_embeddings=128, **TINY)
    shape.update(config)
    if model_type == "bert":
        model = transformers.BertModel(transformers.BertConfig(**shape))
    elif model_type == "distilbert":
        names = dict(hidden_size="dim", num_hidden_layers="n_layers", num_attention_heads="n_heads")
        names["intermediate_size"] = "hidden_dim"
        config = transformers.DistilBertConfig(**{names.get(k, k): v for k, v in shape.items()})
        model = transformers.DistilBertModel(config)
    else:
        shape["max_position_embeddings"] += 2
        config = transformers.XLMRobertaConfig(pad_token_id=1, type_vocab_size=1, **shape)
        model = transformers.XLMRobertaModel(config)
    randomize(model, 0)
    model.save_pretrained(folder)
    return str(folder)


def hf_tokenizer(folder: str) -> Tokenizer:
    """The folder's tokenizer as transformers' reads it, less the leftover truncation."""
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    tok.no_truncation()
    return tok


def hf_rows(folder: str, texts: list[str]) -> list[torch.Tensor]:
    """transformers' last hidden states of each text alone, and the ids it read."""
    tok = hf_tokenizer(folder)
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([tok.encode(t).ids])).last_hidden_state[0] for t in texts]


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    return encoder_folder(tmp_path_factory.mktemp("enc") / "bert")


def close(got: list[float] | torch.Tensor, want: list[float] | torch.Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta", "distilbert"])
def test_cls_embeddings_equal_transformers_batched_and_whole(tmp_path, model_type):
    """No modules.json: the CLS row, unit length (as vLLM pools BertModel). All five texts in one
    step, two of them of one length; then with a step budget of 48 tokens, which the longest
    (47) waits a step for rather than being cut: the same vectors, every prompt whole in its
    step, no block held after, nothing read from a cache the second time."""
    folder = encoder_folder(tmp_path / model_type, model_type)
    want = [torch.nn.functional.normalize(h[0], dim=0) for h in hf_rows(folder, TEXTS)]
    for budget, steps in ((2048, 1), (48, 2)):
        llm = LLM(
            folder, dtype="float32", block_size=4, max_num_batched_tokens=budget, max_model_len=48
        )
        assert llm.engine.pooler == Pooler("CLS", True)
        scheduler = llm.engine.scheduler
        total = scheduler.kv.num_free_blocks()
        schedule, seen = scheduler.schedule, []

        def recorded(schedule=schedule, seen=seen):
            out = schedule()
            if out.scheduled:
                seen.append([(s.num_new_tokens, len(s.seq.token_ids)) for s in out.scheduled])
            return out

        scheduler.schedule = recorded  # type: ignore[method-assign]
        for _ in range(2):
            outs = llm.embed(TEXTS, use_tqdm=False)
            for out, ref in zip(outs, want):
                close(out.outputs.embedding, ref)
            assert scheduler.kv.num_free_blocks() == total
        assert len(seen) == 2 * steps
        assert all(n == length for step in seen for n, length in step)


def test_sentence_transformers_mean_pooling_its_length_and_lowercase(bert, tmp_path):
    """A sentence-transformers folder: MEAN over every token, unit length; its
    sentence_bert_config.json caps the context (a longer prompt is refused, or truncated as
    asked) and lowercases every text first (do_lower_case)."""
    folder = Path(
        sentence_transformers_folder(bert, tmp_path / "st", "pooling_mode_mean_tokens", True)
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 20, "do_lower_case": True})
    )
    llm = LLM(str(folder), dtype="float32", block_size=4)
    assert llm.engine.pooler == Pooler("MEAN", True)
    assert llm.engine.max_model_len == 20
    short = TEXTS[:4]
    want = [torch.nn.functional.normalize(h.mean(0), dim=0) for h in hf_rows(bert, short)]
    outs = llm.embed([t.upper() for t in short], use_tqdm=False)
    for out, ref in zip(outs, want):
        close(out.outputs.embedding, ref)
    with pytest.raises(ParamError, match="20"):
        llm.embed(TEXTS[4], use_tqdm=False)
    tok = hf_tokenizer(bert)
    ids = tok.encode(TEXTS[4]).ids  # [CLS] 45 tokens [SEP]
    cut = llm.embed(TEXTS[4], truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[:19] + ids[-1:]  # (a pooling request keeps the first)
    model = transformers.AutoModel.from_pretrained(bert, dtype=torch.float32)
    with torch.no_grad():
        rows = model(torch.tensor([cut.prompt_token_ids])).last_hidden_state[0]
    close(cut.outputs.embedding, torch.nn.functional.normalize(rows.mean(0), dim=0))


def test_truncation_keeps_the_special_tokens_at_either_side():
    """truncate_prompt_tokens N keeps N tokens: the first (right: a pooling request's default,
    as vLLM 0.32) or the last (left: a generation's), with the tokens the tokenizer added at
    either end ([CLS] ... [SEP], a BOS) kept in place; token-id prompts have none."""
    ids = [101, *range(10, 20), 102]
    pool = SamplingParams(max_tokens=1, pooling="CLS", truncate_prompt_tokens=5)
    assert pool.truncate(ids, 64, (1, 1)) == [101, 10, 11, 12, 102]
    assert pool.truncate(ids, 64) == ids[:5]
    pool.truncation_side = "left"
    assert pool.truncate(ids, 64, (1, 1)) == [101, 17, 18, 19, 102]
    gen = SamplingParams(max_tokens=1, truncate_prompt_tokens=4)
    assert gen.truncate(ids[:-1], 64, (1, 0)) == [101, 17, 18, 19]  # (a BOS)
    assert gen.truncate(ids, 64) == ids[-4:]
    assert gen.truncate(ids[:3], 64, (1, 1)) == ids[:3]  # (short enough already)
    assert SamplingParams(truncate_prompt_tokens=-1).truncate(ids, 6, (1, 1)) == [
        101,
        16,
        17,
        18,
        19,
        102,
    ]
    with pytest.raises(ParamError, match="truncation_side must be left or right"):
        SamplingParams(truncation_side="up")


def test_what_an_encoder_cannot_do_is_refused_by_name(bert, tmp_path):
    llm = LLM(bert, dtype="float32")
    with pytest.raises(ConfigError, match="makes embeddings only"):
        llm.generate(TEXTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.config.enable_prefix_caching  # (it keeps no K/V to reuse)
    assert llm.engine.storage.kv_caches == []  # (its blocks only count tokens: no bytes)
    for kwargs, message in [
        ({"enable_lora": True}, "no LoRA adapter on an encoder"),
        ({"quantization": "int8"}, "runs an encoder unquantized"),
        ({"max_num_batched_tokens": 64}, "must hold a whole prompt of --max-model-len 128"),
        ({"runner": "generate"}, "--runner generate"),
        ({"chat_template": "{{ messages }}"}, "--chat-template: an encoder has no chat"),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype: an encoder keeps no K/V"),
        ({"preemption_mode": "swap"}, "--preemption-mode swap: an encoder keeps no K/V"),
    ]:
        with pytest.raises(ConfigError, match=message):
            LLM(bert, dtype="float32", **kwargs)
    config = json.loads(Path(bert, "config.json").read_text())
    for change, message in [
        ({"hidden_act": "silu"}, "unsupported activation 'silu' for an encoder"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
    ]:
        other = tmp_path / next(iter(change))
        other.mkdir()
        for f in Path(bert).iterdir():
            (other / f.name).symlink_to(f)
        (other / "config.json").unlink()
        (other / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=message):
            LLM(str(other), dtype="float32")


def test_served_embeddings_equal_offline_and_text_is_a_400(bert):
    """/v1/embeddings to the real openai client equals LLM.embed; /v1/completions is a 400 that
    says the model makes embeddings only."""
    import openai

    offline = [o.outputs.embedding for o in LLM(bert, dtype="float32").embed(TEXTS, use_tqdm=False)]
    with ServerProcess(bert, *TINY_SERVER, "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        got = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
        for item, want in zip(got.data, offline):
            close(item.embedding, want)
        left = httpx.post(
            f"{server.url}/v1/embeddings",
            json={"input": TEXTS[4], "truncate_prompt_tokens": 9, "truncation_side": "left"},
            timeout=30,
        ).json()
        assert left["usage"]["prompt_tokens"] == 9
        tok = hf_tokenizer(bert)
        ids = tok.encode(TEXTS[4]).ids
        model = transformers.AutoModel.from_pretrained(bert, dtype=torch.float32)
        with torch.no_grad():  # ([CLS], the last 7 tokens, [SEP])
            rows = model(torch.tensor([ids[:1] + ids[-8:]])).last_hidden_state[0]
        close(left["data"][0]["embedding"], torch.nn.functional.normalize(rows[0], dim=0))
        r = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "the cat", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 400
        assert "embeddings only" in r.json()["error"]["message"]


def cross_encoder_folder(src: str, dst: Path, num_labels: int = 1) -> str:
    """The encoder as a *ForSequenceClassification checkpoint, its head random."""
    import shutil

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        src, num_labels=num_labels, dtype=torch.float32
    )
    randomize(model, 1, only=("classifier", "pre_classifier", "bert.pooler"))
    model.save_pretrained(dst)
    shutil.copy(f"{src}/tokenizer.json", dst)
    return str(dst)


def hf_logits(folder: str, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """transformers' logits of each pair as its tokenizer joins them (token types included)."""
    tok = hf_tokenizer(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    rows = []
    with torch.no_grad():
        for query, doc in pairs:
            enc = tok.encode(query, doc)
            types = {"token_type_ids": torch.tensor([enc.type_ids])}
            if model.config.model_type == "distilbert":  # (no token types)
                types = {}
            rows.append(model(input_ids=torch.tensor([enc.ids]), **types).logits[0])
    return torch.stack(rows)


QUERY = "the cat sat"
DOCS = TEXTS[1:4]


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta", "distilbert"])
def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path, model_type):
    """BertForSequenceClassification, XLMRobertaForSequenceClassification (ms-marco-MiniLM,
    bge-reranker) and DistilBertForSequenceClassification: each query-document pair as the
    tokenizer joins them, the second text of type 1 (BERT), through the dense + tanh head
    (DistilBERT's: ReLU) and the biased projection: the sigmoid equals transformers' (1:N and
    N:N), and without use_activation the logit."""
    base = encoder_folder(tmp_path / "base", model_type)
    folder = cross_encoder_folder(base, tmp_path / "cross")
    llm = LLM(folder, dtype="float32", block_size=4)
    want = hf_logits(folder, [(QUERY, d) for d in DOCS])[:, 0]
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    close(got, torch.sigmoid(want))
    pairs = list(zip(DOCS, reversed(DOCS)))
    got = llm.score([a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False)
    close([o.outputs.score for o in got], torch.sigmoid(hf_logits(folder, pairs)[:, 0]))
    from pagedkv.engine.pooling import PoolingParams

    raw = llm.score(QUERY, DOCS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    close([o.outputs.score for o in raw], want)


def test_a_bert_classifier_of_three_labels_and_a_served_rerank(bert, tmp_path):
    """A three-label BERT classifier: LLM.classify's softmax equals transformers' on one text;
    a one-label one served: /rerank orders the documents by transformers' scores."""
    three = cross_encoder_folder(bert, tmp_path / "three", num_labels=3)
    tok = hf_tokenizer(three)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(three)
    with torch.no_grad():
        want = [model(torch.tensor([tok.encode(t).ids])).logits[0].softmax(-1) for t in TEXTS]
    got = LLM(three, dtype="float32").classify(TEXTS, use_tqdm=False)
    close([o.outputs.probs for o in got], torch.stack(want))

    one = cross_encoder_folder(bert, tmp_path / "one")
    scores = torch.sigmoid(hf_logits(one, [(QUERY, d) for d in DOCS])[:, 0])
    pair = hf_tokenizer(one).encode(QUERY, TEXTS[4])  # (a pair cut to 12 keeps its last [SEP])
    ids, types = (x[:11] + x[-1:] for x in (pair.ids, pair.type_ids))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(one)
    with torch.no_grad():
        logit = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits
    cut = torch.sigmoid(logit[0, 0]).item()
    offline = LLM(one, dtype="float32").score(
        QUERY, TEXTS[4], tokenization_kwargs={"truncate_prompt_tokens": 12}, use_tqdm=False
    )
    assert offline[0].outputs.score == pytest.approx(cut, abs=1e-5)
    with ServerProcess(one, *TINY_SERVER, "--dtype", "float32") as server:
        r = httpx.post(
            f"{server.url}/rerank",
            json={"query": QUERY, "documents": [TEXTS[4]], "truncate_prompt_tokens": 12},
            timeout=60,
        )
        assert r.json()["results"][0]["relevance_score"] == pytest.approx(cut, abs=1e-5)
        r = httpx.post(f"{server.url}/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == scores.argsort(descending=True).tolist()
        close([x["relevance_score"] for x in results], scores.sort(descending=True).values)


def test_a_dense_module_projects_the_pooled_vector(bert, tmp_path):
    """sentence-transformers' Dense module (LaBSE's): tanh(W x + b) of the pooled vector, before
    Normalize; `dimensions` counts its outputs; a cosine score is of the projected vectors; a
    module of another kind is refused by name."""
    from safetensors.torch import save_file

    folder = Path(
        sentence_transformers_folder(bert, tmp_path / "st", "pooling_mode_mean_tokens", True)
    )
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    modules.insert(2, dense)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text(
        json.dumps(
            {
                "in_features": 64,
                "out_features": 32,
                "bias": True,
                "activation_function": "torch.nn.modules.activation.Tanh",
            }
        )
    )
    torch.manual_seed(2)
    w, b = torch.randn(32, 64) * 0.3, torch.randn(32) * 0.3
    save_file({"linear.weight": w, "linear.bias": b}, str(folder / "2_Dense" / "model.safetensors"))
    llm = LLM(str(folder), dtype="float32")
    means = [h.mean(0) for h in hf_rows(bert, TEXTS)]
    want = [torch.nn.functional.normalize(torch.tanh(w @ m + b), dim=0) for m in means]
    for out, ref in zip(llm.embed(TEXTS, use_tqdm=False), want):
        close(out.outputs.embedding, ref)
    from pagedkv.engine.pooling import PoolingParams

    short = llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    close(short[0].outputs.embedding, torch.nn.functional.normalize(want[0][:16], dim=0))
    with pytest.raises(ParamError, match="dimensions must be from 1 to the model's 32"):
        llm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=33), use_tqdm=False)
    score = llm.score(TEXTS[0], TEXTS[1], use_tqdm=False)[0].outputs.score
    assert score == pytest.approx(float(want[0] @ want[1]), abs=1e-5)
    modules[2]["type"] = "sentence_transformers.models.LayerNorm"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="module LayerNorm is not supported"):
        LLM(str(folder), dtype="float32")


def modernbert_folder(folder: Path, task: str = "base", **config) -> str:
    """A random ModernBERT of four layers (the first and last attend to all, the middle two to
    a window of 4 either way), the BERT test tokenizer, every weight random."""
    encoder_folder(folder, "bert")  # (its tokenizer; the model is replaced)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    shape = transformers.ModernBertConfig(
        vocab_size=len(vocab),
        num_hidden_layers=4,
        local_attention=8,
        max_position_embeddings=256,
        pad_token_id=vocab["[PAD]"],
        cls_token_id=vocab["[CLS]"],
        sep_token_id=vocab["[SEP]"],
        bos_token_id=vocab["[CLS]"],
        eos_token_id=vocab["[SEP]"],
        **TINY,
        **config,
    )
    kind = {
        "base": transformers.ModernBertModel,
        "classifier": transformers.ModernBertForSequenceClassification,
    }[task]
    model = kind(shape)
    randomize(model, 3)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(folder)
    return str(folder)


def test_modernbert_embeddings_equal_transformers_and_its_published_config(tmp_path):
    """ModernBERT (gte-modernbert, modernbert-embed): RoPE of two bases, window layers that see 4
    tokens either way (the longest text is 47), GeGLU, pre-norm: the CLS row equals
    transformers'; the same from the config as the published checkpoints write it
    (global_attn_every_n_layers, global_rope_theta, local_rope_theta)."""
    folder = Path(modernbert_folder(tmp_path / "modernbert"))
    want = [torch.nn.functional.normalize(h[0], dim=0) for h in hf_rows(str(folder), TEXTS)]
    for out, ref in zip(LLM(str(folder), dtype="float32").embed(TEXTS, use_tqdm=False), want):
        close(out.outputs.embedding, ref)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    assert config.pop("layer_types") == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ]
    config.update(
        global_attn_every_n_layers=3,
        global_rope_theta=rope["full_attention"]["rope_theta"],
        local_rope_theta=rope["sliding_attention"]["rope_theta"],
    )
    (folder / "config.json").write_text(json.dumps(config))
    for out, ref in zip(LLM(str(folder), dtype="float32").embed(TEXTS, use_tqdm=False), want):
        close(out.outputs.embedding, ref)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_modernbert_cross_encoder_scores_as_transformers(tmp_path, pooling):
    """ModernBertForSequenceClassification (gte-reranker-modernbert): its classifier_pooling,
    then dense, GELU and LayerNorm, then the biased projection: the sigmoid equals
    transformers' on each pair as the tokenizer joins them."""
    folder = modernbert_folder(
        tmp_path / "cross", "classifier", num_labels=1, classifier_pooling=pooling
    )
    llm = LLM(folder, dtype="float32")
    want = torch.sigmoid(hf_logits(folder, [(QUERY, d) for d in DOCS])[:, 0])
    close([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)], want)


def test_an_encoder_gives_each_token_its_vector(bert):
    """vLLM's token_embed on an encoder: every prompt token's own row (unit length), each equal
    to transformers' row; its CLS row equals the embedding."""
    llm = LLM(bert, dtype="float32")
    outs = llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for out, rows in zip(outs, hf_rows(bert, TEXTS)):
        got = torch.as_tensor(out.outputs.data)
        close(got, torch.nn.functional.normalize(rows, dim=-1))
    first = llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding
    close(first, torch.as_tensor(outs[0].outputs.data)[0])


def embeddinggemma_folder(folder: Path, **config) -> str:
    """A random Gemma 3 text model attending both ways (EmbeddingGemma's config): four layers, the
    third attending to all, the others to keys closer than 8 either way; 4 query heads over 2 K/V
    heads; RoPE of two bases; every weight random (its norms' too)."""
    encoder_folder(folder, "bert")  # (its tokenizer; the model is replaced)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    shape = transformers.Gemma3TextConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        max_position_embeddings=128,
        use_bidirectional_attention=True,
        pad_token_id=vocab["[PAD]"],
        **config,
    )
    model = transformers.Gemma3TextModel(shape)
    randomize(model, 5)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(folder)
    return str(folder)


def dense_module(folder: Path, index: int, weight: torch.Tensor) -> None:
    """A Dense module without bias or activation (EmbeddingGemma's two), after the others."""
    from safetensors.torch import save_file

    modules = json.loads((folder / "modules.json").read_text())
    path = f"{index}_Dense"
    dense = {"idx": index, "name": str(index), "path": path}
    modules.insert(index, {**dense, "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / path).mkdir()
    (folder / path / "config.json").write_text(
        json.dumps(
            {
                "in_features": weight.shape[1],
                "out_features": weight.shape[0],
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    save_file({"linear.weight": weight.contiguous()}, str(folder / path / "model.safetensors"))


def test_embeddinggemma_equals_transformers_and_sentence_transformers(tmp_path):
    """Gemma 3's text model attending both ways (the longest text, 47 tokens, is wider than the
    window of 8 either way): mean of transformers' hidden states by default; as
    sentence-transformers ships EmbeddingGemma, that mean through two Dense modules (64 -> 96
    -> 48), then unit length. It only makes embeddings."""
    folder = Path(embeddinggemma_folder(tmp_path / "gemma"))
    rows = hf_rows(str(folder), TEXTS)
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.pooler == Pooler("MEAN", True)
    for out, h in zip(llm.embed(TEXTS, use_tqdm=False), rows):
        close(out.outputs.embedding, torch.nn.functional.normalize(h.mean(0), dim=0))
    with pytest.raises(ConfigError, match="makes embeddings only"):
        llm.generate(TEXTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    st = Path(
        sentence_transformers_folder(str(folder), tmp_path / "st", "pooling_mode_mean_tokens", True)
    )
    torch.manual_seed(6)
    up, down = torch.randn(96, 64) * 0.2, torch.randn(48, 96) * 0.2
    dense_module(st, 2, up)
    dense_module(st, 3, down)
    llm = LLM(str(st), dtype="float32")
    for out, h in zip(llm.embed(TEXTS, use_tqdm=False), rows):
        close(out.outputs.embedding, torch.nn.functional.normalize(down @ (up @ h.mean(0)), dim=0))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma2"}))
    with pytest.raises(ConfigError, match="use_bidirectional_attention=true"):
        LLM(str(folder), dtype="float32")

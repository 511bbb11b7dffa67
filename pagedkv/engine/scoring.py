"""Scores of text pairs (/score, /rerank, LLM.score) and a classifier's labels (/classify,
LLM.classify), as vLLM computes them.

An embedding model (a bi-encoder) embeds each text on its own and scores a pair by the cosine of
the two vectors; a query scored against many documents is embedded once. An LLM used as a
reranker (a cross-encoder: Qwen3-Reranker, bge-reranker-v2-gemma, mxbai-rerank-v2) reads each
pair as one prompt, the query then the document (or a --chat-template given the messages
{"role": "query"} and {"role": "document"}), and its last token's hidden state meets a classifier
made of LM-head rows, as vLLM's --hf-overrides asks (or a *ForSequenceClassification checkpoint's
own one-label head, score.weight, as the "seq-cls" conversions of these rerankers ship):
- method "from_2_way_softmax", tokens [false, true]: the true token's row less the false one's.
  Its sigmoid is the probability of the true token against the false one (Qwen3-Reranker's
  softmax over "no" and "yes");
- method "no_post_processing", one token: that row, whose sigmoid is the score.
A *ForSequenceClassification checkpoint of more labels (a sentiment or topic classifier) scores no
pairs; /classify gives each text its labels' probabilities: a softmax over the labels, or a sigmoid
for each where the labels are independent (problem_type multi_label_classification) or one.
Either way every text runs as an embedding request (pooling, engine/pooling.py), so it batches,
chunks, preempts and meets the prefix cache like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv.config import ConfigError
from pagedkv.engine.chat import render_chat
from pagedkv.engine.request import ParamError
from pagedkv.model.encoder import Encoder

if TYPE_CHECKING:
    from pagedkv.model.llama import LlamaForCausalLM
    from pagedkv.model.tokenizer import Tokenizer

SCORE_METHODS = {"from_2_way_softmax": 2, "no_post_processing": 1}  # -> tokens it takes
_OVERRIDES = ("architectures", "classifier_from_token", "method", "is_original_qwen3_reranker")
_SEQ_CLS = "ForSequenceClassification"


@dataclass(frozen=True)
class ClassifierSpec:
    """What --hf-overrides asks for: a head of these tokens' LM-head rows, combined by method."""

    tokens: tuple[str, ...]
    method: str

    @classmethod
    def of(cls, overrides: dict | str | None) -> ClassifierSpec | None:
        """Checked before any weight loads; None where no classifier is asked for."""
        if not overrides:
            return None
        assert isinstance(overrides, dict)  # (EngineConfig read the flag's JSON)
        unknown = sorted(set(overrides) - set(_OVERRIDES))
        if unknown:
            raise ConfigError(
                f"--hf-overrides: {', '.join(unknown)} not supported ({', '.join(_OVERRIDES)})"
            )
        archs = overrides.get("architectures", [])
        if not (isinstance(archs, list) and len(archs) <= 1 and all(type(a) is str for a in archs)):
            raise ConfigError("--hf-overrides: architectures must be a list of one name")
        if archs and not archs[0].endswith(_SEQ_CLS):
            raise ConfigError(
                f"--hf-overrides: architectures may only name a *{_SEQ_CLS} (a reranker), not "
                f"{archs[0]}: the checkpoint's own architecture is read from it"
            )
        qwen3 = overrides.get("is_original_qwen3_reranker", False)
        if not isinstance(qwen3, bool):
            raise ConfigError("--hf-overrides: is_original_qwen3_reranker must be true or false")
        method = overrides.get("method", "from_2_way_softmax" if qwen3 else None)
        tokens = overrides.get("classifier_from_token")
        if tokens is None:
            if method is not None or any(a.endswith(_SEQ_CLS) for a in archs):
                raise ConfigError(
                    "--hf-overrides: a classifier needs classifier_from_token (pagedkv makes its "
                    "head of those tokens' LM-head rows)"
                )
            return None
        if not (isinstance(tokens, list) and tokens and all(type(t) is str for t in tokens)):
            raise ConfigError("--hf-overrides: classifier_from_token must be a list of tokens")
        if method not in SCORE_METHODS or (qwen3 and method != "from_2_way_softmax"):
            raise ConfigError(
                "--hf-overrides: method must be from_2_way_softmax (two tokens: false, true) or "
                "no_post_processing (one token)"
                + ("; is_original_qwen3_reranker means from_2_way_softmax" if qwen3 else "")
            )
        if len(tokens) != SCORE_METHODS[method]:
            raise ConfigError(
                f"--hf-overrides: method {method} takes {SCORE_METHODS[method]} token(s) in "
                f"classifier_from_token, got {len(tokens)} (pagedkv scores one label)"
            )
        return cls(tuple(tokens), method)


@dataclass(frozen=True)
class Classifier:
    """A classifier's head: float32 rows, one a label, that the pooled hidden state meets (a
    cross-encoder's has one), and their bias where it has one; an encoder's first makes
    something else of the pooled state (`head`: BERT's tanh of a dense layer, ...)."""

    rows: torch.Tensor  # [labels, hidden]
    labels: tuple[str, ...] = ("LABEL_0",)
    multi_label: bool = False
    bias: torch.Tensor | None = None  # [labels]
    head: Callable[[torch.Tensor], torch.Tensor] | None = None
    # a pair is its tokenizer's pair of texts ([CLS] query [SEP] document [SEP]: an encoder's),
    # not one text of the query then the document
    text_pairs: bool = False

    @classmethod
    def of_model(
        cls,
        spec: ClassifierSpec | None,
        model: LlamaForCausalLM | Encoder,
        tokenizer: Tokenizer,
    ) -> Classifier | None:
        """The engine's: what --hf-overrides asks for, or a *ForSequenceClassification
        checkpoint's own head (score.weight); None for neither."""
        if model.score is None:
            return cls.of(spec, tokenizer.token_id, model.head_rows) if spec else None
        if spec is not None:
            raise ConfigError(
                "--hf-overrides: this checkpoint is a classifier with a score head of its own"
            )
        config, rows = model.config, model.score.detach().float()
        if not isinstance(model, Encoder):
            return cls(rows, config.labels, config.multi_label, model.score_bias)
        assert model.score_bias is not None  # (with score)
        bias = model.score_bias.detach()
        return cls(rows, config.labels, config.multi_label, bias, model.classifier_head, True)

    @classmethod
    def of(
        cls,
        spec: ClassifierSpec,
        token_id: Callable[[str], int | None],
        head_rows: Callable[[list[int]], torch.Tensor],
    ) -> Classifier:
        ids = []
        for token in spec.tokens:
            i = token_id(token)
            if i is None:
                raise ConfigError(
                    f"--hf-overrides: classifier_from_token {token!r} is not a token of this "
                    "model's vocabulary"
                )
            ids.append(i)
        rows = head_rows(ids)
        return cls((rows[1] - rows[0] if spec.method == "from_2_way_softmax" else rows[0])[None])

    def check_pairs(self) -> None:
        """Refuse to score pairs with more than one label, saying what it does instead."""
        if len(self.labels) != 1:
            raise ConfigError(
                f"this classifier has {len(self.labels)} labels and scores no pairs (a reranker "
                "has one): /classify and LLM.classify give its labels' probabilities"
            )

    def score(self, vector: torch.Tensor, use_activation: bool = True) -> float:
        """A one-label head's sigmoid of its row times the hidden state, or without
        use_activation the logit."""
        return float(self.probs(vector, use_activation)[0])

    def probs(self, vector: torch.Tensor, use_activation: bool = True) -> torch.Tensor:
        """Each label's probability (softmax over the labels, or a sigmoid each where they are
        independent or one), or without use_activation their logits; of a hidden state, or of
        each of a per-token task's."""
        if self.head is not None:
            vector = self.head(vector)
        logits = vector @ self.rows.T
        if self.bias is not None:
            logits = logits + self.bias
        if not use_activation:
            return logits
        sigmoid = self.multi_label or len(self.labels) == 1
        return torch.sigmoid(logits) if sigmoid else torch.softmax(logits, -1)

    def label(self, probs: list[float]) -> str:
        """The most likely label's name (the first of ties)."""
        return self.labels[max(range(len(probs)), key=probs.__getitem__)]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@dataclass(frozen=True)
class ScorePlan:
    """The prompts a scoring runs (each an embedding request), and for each pair scored the
    prompts whose vectors make its score: (i, j) for a bi-encoder's cosine, (i, i) for a
    cross-encoder's one prompt."""

    prompts: list[str | list[int]]  # (a pair of texts comes tokenized)
    pairs: list[tuple[int, int]]
    classifier: Classifier | None

    def scores(self, vectors: Sequence[torch.Tensor], use_activation: bool = True) -> list[float]:
        if self.classifier is not None:
            return [self.classifier.score(vectors[i], use_activation) for i, _ in self.pairs]
        return [cosine(vectors[i], vectors[j]) for i, j in self.pairs]


def plan(
    data_1: str | list[str],
    data_2: str | list[str],
    classifier: Classifier | None,
    tokenizer,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    names: tuple[str, str] = ("data_1", "data_2"),
) -> ScorePlan:
    """Pairs as vLLM makes them: one query against each document (1:N), or the n-th with the
    n-th (N:N). `names`: the request's fields, for the errors."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in zip(names, (first, second)):
        if not texts:
            raise ParamError(name, f"{name} must hold at least one text")
        if not all(isinstance(t, str) for t in texts):
            raise ParamError(name, f"{name} must be a string or a list of strings")
    if len(first) > 1 and len(first) != len(second):
        raise ParamError(
            names[0],
            f"{names[0]} holds {len(first)} texts and {names[1]} {len(second)}: pairs are one "
            "against many (1:N) or one to one (N:N)",
        )
    which = [0 if len(first) == 1 else j for j in range(len(second))]
    if classifier is None:
        if template_kwargs:
            raise ParamError(
                "chat_template_kwargs",
                "instruction and chat_template_kwargs shape a cross-encoder's pairs; this model "
                "embeds each text (a bi-encoder)",
            )
        n = len(first)
        each: list[str | list[int]] = [*first, *second]
        return ScorePlan(each, [(i, n + j) for j, i in enumerate(which)], None)
    classifier.check_pairs()
    if classifier.text_pairs and template_kwargs:
        raise ParamError(
            "chat_template_kwargs",
            "instruction and chat_template_kwargs shape a score template; this cross-encoder "
            "reads each pair as its tokenizer's pair of texts",
        )
    prompts: list[str | list[int]] = [
        tokenizer.encode_pair(first[i], doc)
        if classifier.text_pairs
        else pair_prompt(tokenizer, first[i], doc, chat_template, template_kwargs)
        for i, doc in zip(which, second)
    ]
    return ScorePlan(prompts, [(j, j) for j in range(len(prompts))], classifier)


def pair_prompt(
    tokenizer, query: str, document: str, chat_template: str | None, kwargs: dict | None
) -> str:
    """A cross-encoder's prompt: query then document, or the template's rendering of them."""
    if chat_template is None:
        if kwargs:
            raise ParamError(
                "chat_template_kwargs",
                "instruction and chat_template_kwargs need a score template (--chat-template)",
            )
        return query + document
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    return render_chat(
        tokenizer,
        messages,
        add_generation_prompt=False,
        chat_template=chat_template,
        chat_template_kwargs=kwargs,
        content_format="string",
    )

"""Encoders (BERT, RoBERTa, XLM-RoBERTa): the embedding models most sentence-transformers
checkpoints are (all-MiniLM, bge, e5, gte; multilingual-e5, bge-m3).

Every token attends to every token of its prompt, before and after it, so a prompt runs whole in
one step (the scheduler never chunks one: `Scheduler(whole_prompts=True)`) and nothing of it is
kept: no K/V is written to the paged cache or read from it, and no prefix is cached. Each prompt
is one span of the step's rows; the spans attend apart, batched by length. The engine pools the
hidden states this returns (CLS by default, or as the folder's sentence-transformers modules say).

A classifier (a cross-encoder: BertForSequenceClassification, XLMRobertaForSequenceClassification)
has a head on the CLS row, the same in both: tanh of a dense layer (BERT's pooler, RoBERTa's
classifier.dense), then a projection with a bias to the labels (engine/scoring.py applies it).

Token types: a token is of type 0 (one text, as an embedding reads it), whose embedding is folded
into the position table as the weights load; in a BERT classifier, whose tokenizer makes a pair
[CLS] query [SEP] document [SEP], the tokens after a prompt's first [SEP] are of type 1, as the
tokenizer marks a pair's second text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedkv.attention.paged import AttentionMetadata
from pagedkv.config import ConfigError
from pagedkv.model.config import LlamaConfig
from pagedkv.model.quant_linear import Blocks

# a layer's tensors under their checkpoint names (after `encoder.layer.N.`): ours, and which
# third of the fused q/k/v projection each of q, k and v fills
_LAYER = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("out", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up", None),
    "output.dense": ("down", None),
    "output.LayerNorm": ("mlp_norm", None),
}
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "word.weight",
    "embeddings.position_embeddings.weight": "position.weight",
    "embeddings.LayerNorm.weight": "norm.weight",
    "embeddings.LayerNorm.bias": "norm.bias",
}
_TOKEN_TYPES = "embeddings.token_type_embeddings.weight"
# what a checkpoint's names start with: BertModel's none, the task models' their base's name
_PREFIXES = ("bert.", "roberta.", "model.")
# a classifier's head: BERT's and RoBERTa's names for its dense layer and its projection
_HEAD = {
    "pooler.dense.weight": "head_dense.weight",
    "pooler.dense.bias": "head_dense.bias",
    "classifier.weight": "score",
    "classifier.bias": "score_bias",
    "classifier.dense.weight": "head_dense.weight",
    "classifier.dense.bias": "head_dense.bias",
    "classifier.out_proj.weight": "score",
    "classifier.out_proj.bias": "score_bias",
}
# tensors read past: a base model's pooler (a dense + tanh that sentence-transformers skips),
# a masked LM's head, old checkpoints' position-id buffers
_UNUSED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids")


class EncoderLayer(nn.Module):
    """Attention, then the MLP, each added to its input and then normalized (post-norm)."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.out = nn.Linear(hidden, hidden, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.up = nn.Linear(hidden, config.intermediate_size, dtype=dtype)
        self.down = nn.Linear(config.intermediate_size, hidden, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(hidden, eps, dtype=dtype)
        self.approximate = "tanh" if config.hidden_act == "gelu_tanh" else "none"

    def forward(self, x: Tensor, spans: list[Tensor]) -> Tensor:
        """x [T, hidden]; spans: the rows of each group of prompts of one length ([prompts,
        length] indices into x)."""
        q, k, v = self.qkv(x).view(-1, 3, self.heads, self.head_dim).unbind(1)
        mixed = torch.empty_like(x)
        for rows in spans:  # [prompts, length, heads, dim] -> [prompts, heads, length, dim]
            out = F.scaled_dot_product_attention(
                q[rows].transpose(1, 2), k[rows].transpose(1, 2), v[rows].transpose(1, 2)
            )
            mixed[rows.flatten()] = out.transpose(1, 2).flatten(2).flatten(0, 1)
        x = self.attn_norm(x + self.out(mixed))
        return self.mlp_norm(x + self.down(F.gelu(self.up(x), approximate=self.approximate)))


class EncoderModel(nn.Module):
    """An encoder's embeddings and layers; `forward` takes what LlamaForCausalLM's does, so the
    runner runs either."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, context: int | None = None) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.context = context or config.max_position_embeddings
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        table = config.max_position_embeddings + config.position_offset
        self.position = nn.Embedding(table, hidden, dtype=dtype)
        self.norm = nn.LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(
            EncoderLayer(config, dtype) for _ in range(config.num_hidden_layers)
        )
        # a classifier's head (float32, as LlamaForCausalLM's score), None for an embedding model
        labels = config.num_labels
        self.score = nn.Parameter(torch.zeros(labels, hidden)) if labels else None
        self.score_bias = nn.Parameter(torch.zeros(labels)) if labels else None
        self.head_dense = nn.Linear(hidden, hidden) if labels else None
        # type 1's embedding less type 0's, for a classifier's pairs (set as the weights load)
        self.second_text: Tensor | None = None
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: object,
        meta: AttentionMetadata,
        lora: object = None,
    ) -> Tensor:
        """Hidden states [T, hidden] of the step's prompts, each whole (kv_caches unused)."""
        if lora is not None:
            raise ConfigError("an encoder runs no LoRA adapter")
        spans = prompt_spans(meta)
        offset = self.config.position_offset
        x = self.word(input_ids) + self.position(positions + offset)
        sep = self.config.sep_token_id
        if self.second_text is not None and sep is not None:
            second = second_texts(input_ids, spans, sep)
            x += second[:, None] * self.second_text
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        raise RuntimeError("an encoder makes no logits: it only pools")

    def head_rows(self, ids: list[int]) -> Tensor:
        raise ConfigError("--hf-overrides: an encoder has no LM head to make a classifier of")

    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters())

    def prepack_weights(self) -> None:
        """(Nothing to prepack: the encoder's matmuls are torch's own.)"""

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, Tensor | Blocks] | Iterable[tuple[str, Tensor | Blocks]]
    ) -> None:
        """Copy a checkpoint's tensors in (BertModel's names, or a task model's with its
        `bert.` / `roberta.` prefix), fusing q, k and v; the type-0 token embedding is added to
        every position's."""
        params = dict(self.named_parameters())
        done: set[str] = set()
        token_types: Tensor | None = None
        for stored, tensor in weights.items() if isinstance(weights, Mapping) else weights:
            name = next((stored[len(p) :] for p in _PREFIXES if stored.startswith(p)), stored)
            if self.score is not None and name in _HEAD:
                name = _HEAD[name]
            elif name.startswith(_UNUSED):
                continue
            if name == _TOKEN_TYPES and isinstance(tensor, Tensor):
                token_types = tensor
                continue
            target = _EMBEDDINGS.get(name) or (name if name in _HEAD.values() else None)
            part = None
            if target is None and name.startswith("encoder.layer."):
                index, _, rest = name[len("encoder.layer.") :].partition(".")
                module, _, leaf = rest.rpartition(".")
                leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)  # (old LayerNorms)
                if module in _LAYER and index.isdigit() and int(index) < len(self.layers):
                    ours, part = _LAYER[module]
                    target = f"layers.{index}.{ours}.{leaf}"
            if target is None or target not in params:
                raise ConfigError(f"unexpected weight {stored!r} for an encoder")
            param = params[target]
            if part is not None:
                third = param.shape[0] // 3
                param = param[part * third : (part + 1) * third]  # type: ignore[assignment]
                target = f"{target}:{part}"
            if not isinstance(tensor, Tensor) or tuple(param.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"weight {stored} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)
            done.add(target)
        fused = {n for n in params if ".qkv." in n}
        required = (set(params) - fused) | {f"{n}:{i}" for n in fused for i in range(3)}
        missing = sorted(required - done)
        if missing:
            raise ConfigError(
                f"missing weights: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )
        if token_types is not None:
            self.position.weight += token_types[0].to(self.dtype)
            pairs = self.score is not None and self.config.sep_token_id is not None
            if pairs and len(token_types) > 1:
                self.second_text = (token_types[1] - token_types[0]).to(self.dtype)


def second_texts(input_ids: Tensor, spans: list[Tensor], sep: int) -> Tensor:
    """1 for each row after its prompt's first `sep`, else 0 ([T], float)."""
    second = torch.zeros(len(input_ids))
    for rows in spans:
        is_sep = torch.eq(input_ids[rows], sep).int()
        second[rows.flatten()] = (is_sep.cumsum(1) > is_sep).float().flatten()
    return second


def prompt_spans(meta: AttentionMetadata) -> list[Tensor]:
    """The step's prompts grouped by length: each group's row indices [prompts, length]. A
    prompt that is not whole in the step (a chunk, or one with K/V already cached) is a bug of the
    caller's, refused here: its other rows would be missing from its attention."""
    groups: dict[int, list[int]] = {}
    start = 0
    for query, seq in zip(meta.query_lens, meta.seq_lens_list):
        if query != seq:
            raise RuntimeError(f"an encoder runs whole prompts: {query} of {seq} tokens given")
        groups.setdefault(query, []).append(start)
        start += query
    device = meta.query_start_loc.device
    return [
        torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
        for n, starts in groups.items()
    ]

"""Encoders (BERT, RoBERTa, XLM-RoBERTa, DistilBERT; ModernBERT; EmbeddingGemma): the embedding
models most sentence-transformers checkpoints are (all-MiniLM, bge, e5, gte; multilingual-e5,
bge-m3; msmarco-distilbert; gte-modernbert, modernbert-embed; embeddinggemma), and their
cross-encoders.

Every token attends to the tokens of its prompt before and after it (all of them, or on
ModernBERT's and EmbeddingGemma's window layers those within its window), so a prompt runs whole in
one step (the scheduler never chunks one: `Scheduler(whole_prompts=True)`) and nothing of it is
kept: no K/V is written to the paged cache or read from it, and no prefix is cached. Each prompt
is one span of the step's rows; the spans attend apart, batched by length. The engine pools the
hidden states this returns (CLS by default, or as the folder's sentence-transformers modules say).

A classifier (a cross-encoder: BertForSequenceClassification, XLMRobertaForSequenceClassification)
has a head on the CLS row, the same in both: tanh of a dense layer (BERT's pooler, RoBERTa's
classifier.dense; DistilBERT's pre_classifier, and ReLU), then a projection with a bias to the
labels (engine/scoring.py applies it);
ModernBertForSequenceClassification's, on its CLS row or the mean of its rows: GELU of a dense
layer, a LayerNorm, then the projection.

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
from pagedkv.model.llama import Rotary
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
    # DistilBERT's (after `transformer.layer.N.`)
    "attention.q_lin": ("qkv", 0),
    "attention.k_lin": ("qkv", 1),
    "attention.v_lin": ("qkv", 2),
    "attention.out_lin": ("out", None),
    "sa_layer_norm": ("attn_norm", None),
    "ffn.lin1": ("up", None),
    "ffn.lin2": ("down", None),
    "output_layer_norm": ("mlp_norm", None),
}
_LAYERS = ("encoder.layer.", "transformer.layer.")  # BERT's, DistilBERT's
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "word.weight",
    "embeddings.position_embeddings.weight": "position.weight",
    "embeddings.LayerNorm.weight": "norm.weight",
    "embeddings.LayerNorm.bias": "norm.bias",
}
_TOKEN_TYPES = "embeddings.token_type_embeddings.weight"
# what a checkpoint's names start with: BertModel's none, the task models' their base's name
_PREFIXES = ("bert.", "roberta.", "distilbert.", "model.")
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
    "pre_classifier.weight": "head_dense.weight",  # (DistilBERT's)
    "pre_classifier.bias": "head_dense.bias",
}
# tensors read past: a base model's pooler (a dense + tanh that sentence-transformers skips),
# a masked LM's head, old checkpoints' position-id buffers
_UNUSED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "head.", "decoder.")
# ModernBERT's names (after `model.`): ours
_MODERN = {
    "embeddings.tok_embeddings.weight": "word.weight",
    "embeddings.norm.weight": "norm.weight",
    "final_norm.weight": "final_norm.weight",
}
_MODERN_LAYER = {  # (after `layers.N.`)
    "attn_norm.weight": "attn_norm.weight",
    "attn.Wqkv.weight": "qkv.weight",
    "attn.Wo.weight": "out.weight",
    "mlp_norm.weight": "mlp_norm.weight",
    "mlp.Wi.weight": "up.weight",
    "mlp.Wo.weight": "down.weight",
}
# EmbeddingGemma's names (after `layers.N.`): ours
_GEMMA_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "q.weight",
    "self_attn.k_proj.weight": "k.weight",
    "self_attn.v_proj.weight": "v.weight",
    "self_attn.q_norm.weight": "q_norm.weight",
    "self_attn.k_norm.weight": "k_norm.weight",
    "self_attn.o_proj.weight": "out.weight",
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "pre_feedforward_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "gate.weight",
    "mlp.up_proj.weight": "up.weight",
    "mlp.down_proj.weight": "down.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}
_MODERN_HEAD = {
    "head.dense.weight": "head_dense.weight",
    "head.norm.weight": "head_norm.weight",
    "classifier.weight": "score",
    "classifier.bias": "score_bias",
}


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


class Encoder(nn.Module):
    """What every encoder shares: `forward` takes what LlamaForCausalLM's does, so the runner
    runs either; a classifier's head (`score`, `score_bias`, `classifier_head`: float32, as
    LlamaForCausalLM's score); the checkpoint's tensors copied in by the names `_target` gives."""

    split_qkv = True  # whether a checkpoint holds q, k and v apart (BERT's) or fused

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, context: int | None) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        self.context = context or config.max_position_embeddings
        labels = config.num_labels
        self.score = nn.Parameter(torch.zeros(labels, config.hidden_size)) if labels else None
        self.score_bias = nn.Parameter(torch.zeros(labels)) if labels else None

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
        return self.encode(input_ids, positions, prompt_spans(meta))

    def encode(self, input_ids: Tensor, positions: Tensor, spans: list[Tensor]) -> Tensor:
        raise NotImplementedError

    def classifier_head(self, vector: Tensor) -> Tensor:
        """What a classifier makes of its pooled vector (float32) before the projection to its
        labels."""
        raise NotImplementedError

    def compute_logits(self, hidden: Tensor) -> Tensor:
        raise RuntimeError("an encoder makes no logits: it only pools")

    def head_rows(self, ids: list[int]) -> Tensor:
        raise ConfigError("--hf-overrides: an encoder has no LM head to make a classifier of")

    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters())

    def prepack_weights(self) -> None:
        """(Nothing to prepack: the encoder's matmuls are torch's own.)"""

    def _target(self, name: str) -> tuple[str, int | None] | None:
        """A checkpoint tensor's parameter (prefix removed) and the third of a fused q/k/v it
        fills (None: all of it); None for a tensor this model does not have."""
        raise NotImplementedError

    def _special(self, name: str, tensor: Tensor) -> bool:
        """Take a tensor that is no parameter's (BERT's token types); whether it was one."""
        return False

    def _loaded(self) -> None:
        """(After every tensor is in.)"""

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, Tensor | Blocks] | Iterable[tuple[str, Tensor | Blocks]]
    ) -> None:
        """Copy a checkpoint's tensors in: the base model's names, or a task model's with its
        prefix (`bert.`, `roberta.`, `model.`); what a base or masked-LM model has beside the
        encoder is passed over, anything else refused, and every parameter must be given."""
        params = dict(self.named_parameters())
        done: set[str] = set()
        for stored, tensor in weights.items() if isinstance(weights, Mapping) else weights:
            if not isinstance(tensor, Tensor):  # (no GGUF file is read for an encoder)
                raise ConfigError(f"weight {stored} is not a plain tensor")
            name = next((stored[len(p) :] for p in _PREFIXES if stored.startswith(p)), stored)
            if self._special(name, tensor):
                continue
            found = self._target(name)
            if found is None and name.startswith(_UNUSED):
                continue
            if found is None or found[0] not in params:
                raise ConfigError(f"unexpected weight {stored!r} for an encoder")
            target, part = found
            param = params[target]
            if part is not None:
                third = param.shape[0] // 3
                param = param[part * third : (part + 1) * third]  # type: ignore[assignment]
                target = f"{target}:{part}"
            if tuple(param.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"weight {stored} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)}"
                )
            param.copy_(tensor)
            done.add(target)
        fused = {n for n in params if ".qkv." in n and self.split_qkv}
        required = (set(params) - fused) | {f"{n}:{i}" for n in fused for i in range(3)}
        missing = sorted(required - done)
        if missing:
            raise ConfigError(
                f"missing weights: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )
        self._loaded()


class EncoderModel(Encoder):
    """BERT, RoBERTa, XLM-RoBERTa, DistilBERT."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, context: int | None = None) -> None:
        super().__init__(config, dtype, context)
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        table = config.max_position_embeddings + config.position_offset
        self.position = nn.Embedding(table, hidden, dtype=dtype)
        self.norm = nn.LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(
            EncoderLayer(config, dtype) for _ in range(config.num_hidden_layers)
        )
        self.head_dense = nn.Linear(hidden, hidden) if config.num_labels else None
        # the token-type embeddings as they load; then type 1's less type 0's, for a
        # classifier's pairs
        self._token_types: Tensor | None = None
        self.second_text: Tensor | None = None
        self.requires_grad_(False)

    def encode(self, input_ids: Tensor, positions: Tensor, spans: list[Tensor]) -> Tensor:
        x = self.word(input_ids) + self.position(positions + self.config.position_offset)
        sep = self.config.sep_token_id
        if self.second_text is not None and sep is not None:
            second = second_texts(input_ids, spans, sep)
            x += second[:, None] * self.second_text
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def classifier_head(self, vector: Tensor) -> Tensor:
        assert self.head_dense is not None  # (a classifier's)
        act = torch.relu if self.config.encoder == "distilbert" else torch.tanh
        return act(self.head_dense(vector))

    def _target(self, name: str) -> tuple[str, int | None] | None:
        if self.score is not None and name in _HEAD:
            return _HEAD[name], None
        if name in _EMBEDDINGS:
            return _EMBEDDINGS[name], None
        prefix = next((p for p in _LAYERS if name.startswith(p)), None)
        if prefix is None:
            return None
        index, _, rest = name[len(prefix) :].partition(".")
        module, _, leaf = rest.rpartition(".")
        leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)  # (old LayerNorms)
        if module not in _LAYER or not index.isdigit():
            return None
        ours, part = _LAYER[module]
        return f"layers.{index}.{ours}.{leaf}", part

    def _special(self, name: str, tensor: Tensor) -> bool:
        if name != _TOKEN_TYPES:
            return False
        self._token_types = tensor
        return True

    def _loaded(self) -> None:
        """The type-0 token embedding added to every position's."""
        types = self._token_types
        if types is None:
            return
        self.position.weight += types[0].to(self.dtype)
        pairs = self.score is not None and self.config.sep_token_id is not None
        if pairs and len(types) > 1:
            self.second_text = (types[1] - types[0]).to(self.dtype)
        self._token_types = None


class ModernBertLayer(nn.Module):
    """LayerNorm (none before the first layer's attention), attention with RoPE (over a window
    on the window layers), each block added to its input; then a LayerNorm and a GeGLU MLP."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        hidden, eps, inner = config.hidden_size, config.rms_norm_eps, config.intermediate_size
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.attn_norm = nn.LayerNorm(hidden, eps, bias=False, dtype=dtype) if index else None
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.out = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.mlp_norm = nn.LayerNorm(hidden, eps, bias=False, dtype=dtype)
        self.up = nn.Linear(hidden, 2 * inner, bias=False, dtype=dtype)
        self.down = nn.Linear(inner, hidden, bias=False, dtype=dtype)
        self.window = config.layer_window(index)  # a key within it either way of the query

    def forward(self, x: Tensor, spans: list[Tensor], rope: tuple[Tensor, Tensor]) -> Tensor:
        """rope: each row's cos and sin [T, 1, head_dim] (rotate_half's sign in sin)."""
        y = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.qkv(y).view(-1, 3, self.heads, self.head_dim).unbind(1)
        cos, sin = rope
        half = self.head_dim // 2
        q, k = (torch.addcmul(t * cos, t.roll(half, dims=-1), sin) for t in (q, k))
        mixed = torch.empty_like(x)
        for rows in spans:
            length, mask = rows.shape[1], None
            if self.window is not None and length > self.window + 1:
                at = torch.arange(length, device=x.device)
                mask = (at[:, None] - at[None, :]).abs() <= self.window
            out = F.scaled_dot_product_attention(
                q[rows].transpose(1, 2),
                k[rows].transpose(1, 2),
                v[rows].transpose(1, 2),
                attn_mask=mask,
            )
            mixed[rows.flatten()] = out.transpose(1, 2).flatten(2).flatten(0, 1)
        x = x + self.out(mixed)
        gelu, gate = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.gelu(gelu) * gate)


class ModernBertModel(Encoder):
    """ModernBERT: token embeddings and their LayerNorm, the layers, a final LayerNorm; a
    classifier's head is a dense layer, GELU and a LayerNorm, then the projection."""

    split_qkv = False

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, context: int | None = None) -> None:
        super().__init__(config, dtype, context)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.word = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.norm = nn.LayerNorm(hidden, eps, bias=False, dtype=dtype)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, dtype, i) for i in range(config.num_hidden_layers)
        )
        self.final_norm = nn.LayerNorm(hidden, eps, bias=False, dtype=dtype)
        labels = config.num_labels
        self.head_dense = nn.Linear(hidden, hidden, bias=False) if labels else None
        self.head_norm = nn.LayerNorm(hidden, eps, bias=False) if labels else None
        self.rotary = Rotary(config, self.context)
        self.local_rotary = Rotary(config, self.context, local=True)
        self.requires_grad_(False)

    def encode(self, input_ids: Tensor, positions: Tensor, spans: list[Tensor]) -> Tensor:
        x = self.norm(self.word(input_ids))
        tables = {
            near: tuple(t[positions][:, None].to(x.dtype) for t in (rot.cos, rot.sin))
            for near, rot in ((False, self.rotary), (True, self.local_rotary))
        }
        for layer in self.layers:
            x = layer(x, spans, tables[layer.window is not None])
        return self.final_norm(x)

    def classifier_head(self, vector: Tensor) -> Tensor:
        assert self.head_dense is not None and self.head_norm is not None  # (a classifier's)
        return self.head_norm(F.gelu(self.head_dense(vector)))

    def _target(self, name: str) -> tuple[str, int | None] | None:
        if self.score is not None and name in _MODERN_HEAD:
            return _MODERN_HEAD[name], None
        if name in _MODERN:
            return _MODERN[name], None
        index, _, rest = name.removeprefix("layers.").partition(".")
        if not (name.startswith("layers.") and index.isdigit() and rest in _MODERN_LAYER):
            return None
        return f"layers.{index}.{_MODERN_LAYER[rest]}", None


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm, as transformers computes it: in float32, times 1 + w."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        f = x.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (f * (1.0 + self.weight.float())).type_as(x)


class GemmaEncoderLayer(nn.Module):
    """Gemma 3's layer attending both ways: each block normalized before and after, then added
    to its input; q and k normalized per head and turned by RoPE; the gated tanh-GELU MLP."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        hidden, eps, inner = config.hidden_size, config.rms_norm_eps, config.intermediate_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = dim = config.head_dim
        self.attn_norm = GemmaNorm(hidden, eps, dtype)
        self.q = nn.Linear(hidden, self.heads * dim, bias=False, dtype=dtype)
        self.k = nn.Linear(hidden, self.kv_heads * dim, bias=False, dtype=dtype)
        self.v = nn.Linear(hidden, self.kv_heads * dim, bias=False, dtype=dtype)
        self.q_norm = GemmaNorm(dim, eps, dtype)
        self.k_norm = GemmaNorm(dim, eps, dtype)
        self.out = nn.Linear(self.heads * dim, hidden, bias=False, dtype=dtype)
        self.post_attn_norm = GemmaNorm(hidden, eps, dtype)
        self.mlp_norm = GemmaNorm(hidden, eps, dtype)
        self.gate = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.up = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.down = nn.Linear(inner, hidden, bias=False, dtype=dtype)
        self.post_mlp_norm = GemmaNorm(hidden, eps, dtype)
        self.window = config.layer_window(index)  # keys closer than it either way
        assert config.query_pre_attn_scalar is not None  # (Gemma 3's config always has one)
        self.scale = config.query_pre_attn_scalar**-0.5

    def forward(self, x: Tensor, spans: list[Tensor], rope: tuple[Tensor, Tensor]) -> Tensor:
        """rope: each row's cos and sin [T, 1, head_dim] (rotate_half's sign in sin)."""
        rows_in = len(x)
        y = self.attn_norm(x)
        q = self.q_norm(self.q(y).view(rows_in, self.heads, self.head_dim))
        k = self.k_norm(self.k(y).view(rows_in, self.kv_heads, self.head_dim))
        v = self.v(y).view(rows_in, self.kv_heads, self.head_dim)
        cos, sin = rope
        half = self.head_dim // 2
        q, k = (torch.addcmul(t * cos, t.roll(half, dims=-1), sin) for t in (q, k))
        mixed = torch.empty_like(q)
        for rows in spans:
            length, mask = rows.shape[1], None
            if self.window is not None and length > self.window:
                at = torch.arange(length, device=x.device)
                mask = (at[:, None] - at[None, :]).abs() < self.window
            out = F.scaled_dot_product_attention(
                q[rows].transpose(1, 2),
                k[rows].transpose(1, 2),
                v[rows].transpose(1, 2),
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=self.kv_heads != self.heads,
            )
            mixed[rows.flatten()] = out.transpose(1, 2).flatten(0, 1)
        x = x + self.post_attn_norm(self.out(mixed.flatten(1)))
        y = self.mlp_norm(x)
        mlp = self.down(F.gelu(self.gate(y), approximate="tanh") * self.up(y))
        return x + self.post_mlp_norm(mlp)


class GemmaEncoderModel(Encoder):
    """EmbeddingGemma: Gemma 3's text model (use_bidirectional_attention): embeddings scaled by
    the square root of the width, the layers (RoPE of two bases, as the decoder's), a final
    norm. No classifier."""

    split_qkv = False

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, context: int | None = None) -> None:
        super().__init__(config, dtype, context)
        if config.num_labels:
            raise ConfigError("a Gemma 3 encoder makes embeddings only: no classifier head")
        hidden = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, hidden, dtype=dtype)
        self.embed_scale = torch.tensor(hidden**0.5, dtype=dtype)  # (rounded to dtype, as HF)
        self.layers = nn.ModuleList(
            GemmaEncoderLayer(config, dtype, i) for i in range(config.num_hidden_layers)
        )
        self.final_norm = GemmaNorm(hidden, config.rms_norm_eps, dtype)
        self.rotary = Rotary(config, self.context)
        self.local_rotary = Rotary(config, self.context, local=True)
        self.requires_grad_(False)

    def encode(self, input_ids: Tensor, positions: Tensor, spans: list[Tensor]) -> Tensor:
        x = self.word(input_ids) * self.embed_scale
        tables = {
            near: tuple(t[positions][:, None].to(x.dtype) for t in (rot.cos, rot.sin))
            for near, rot in ((False, self.rotary), (True, self.local_rotary))
        }
        for layer in self.layers:
            x = layer(x, spans, tables[layer.window is not None])
        return self.final_norm(x)

    def _target(self, name: str) -> tuple[str, int | None] | None:
        if name in ("embed_tokens.weight", "norm.weight"):
            return ("word.weight" if name.startswith("embed") else "final_norm.weight"), None
        index, _, rest = name.removeprefix("layers.").partition(".")
        if not (name.startswith("layers.") and index.isdigit() and rest in _GEMMA_LAYER):
            return None
        return f"layers.{index}.{_GEMMA_LAYER[rest]}", None


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

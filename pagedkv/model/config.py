"""The shape of a Llama-family model, whatever file it came from."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.config import ConfigError

if TYPE_CHECKING:  # (no torch import at run time: `pagedkv plan` reads MODEL_TYPES without it)
    from torch import Tensor

    from pagedkv.model.quant_linear import Blocks
    from pagedkv.model.tokenizer import Tokenizer

# model_type values of config.json whose forward is ours, with what each adds to Llama's
MODEL_TYPES: dict[str, dict[str, Any]] = {  # what each adds to LlamaConfig
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    # mixtures of experts (a router picks each token's experts: model/moe.py)
    "mixtral": {"expert_names": "mixtral", "float_routing_weights": True},
    "granitemoe": {"expert_names": "granite", "softmax_over_chosen": True},  # (and Granite's)
    "qwen2_moe": {"qkv_bias": True},  # (and a shared expert, gated)
    "qwen3_moe": {"qk_norm": True},
    "olmoe": {"qk_norm": True, "qk_norm_whole": True},  # q/k norms over all heads at once
    "phi3": {},  # q/k/v and gate/up fused in the checkpoint (llama.FUSED_WHOLE)
    "smollm3": {},  # some layers without RoPE (NoPE: rope_layers)
    "granite": {},  # four multipliers (embeddings, residual adds, attention scale, logits)
    # Gemma (2B, 7B): norms of (1 + w), embeddings times sqrt(hidden), GELU (tanh)
    "gemma": {"norm_offset": 1.0, "embed_scale": True, "hidden_act": "gelu_tanh"},
    # Gemma 2 adds norms on the attention's and the MLP's outputs (and soft-capping, from the file)
    "gemma2": {
        "norm_offset": 1.0,
        "embed_scale": True,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
    },
    # Gemma 3's text models (270M, 1B) add q/k norms
    "gemma3_text": {
        "qk_norm": True,
        "norm_offset": 1.0,
        "embed_scale": True,
        "sandwich_norms": True,
        "hidden_act": "gelu_tanh",
    },
}
GEMMA = ("gemma", "gemma2", "gemma3_text")
# encoders (model/encoder.py): most sentence-transformers embedding models (all-MiniLM, bge, e5,
# gte: BERT; multilingual-e5, bge-m3: XLM-RoBERTa; msmarco-distilbert, multi-qa-distilbert:
# DistilBERT; gte-modernbert, modernbert-embed: ModernBERT)
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "modernbert")
# DistilBERT's config.json names for BERT's
_DISTILBERT_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "activation": "hidden_act",
}
# their activations, by config.json's hidden_act: the erf GELU or its tanh approximation
ENCODER_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# how a checkpoint names a layer's experts (LlamaConfig.expert_names): the mixture's module, its
# router, and each expert's gate, up and down projections
# (GraniteMoE's checkpoints stack every expert's gate/up and down into one tensor each: none
# per expert, llama.STACKED_EXPERTS)
EXPERT_NAMES = {
    "qwen": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    "granite": ("block_sparse_moe", "router.layer", ()),
}
# llama.cpp's first Mixtral files (before April 2024) hold a tensor an expert, not one a layer
GGUF_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
GEMMA_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's window layers' RoPE base, where a file names none
_DEFAULT_THETA = {"gemma3_text": 1e6, "smollm3": 2e6}  # RoPE bases where a file names none
# Gemma 2's and 3's window layers where a file names none: every n-th layer attends to all
GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6}
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
# Gemma 3's image-and-text checkpoints (4B, 12B, 27B): served as their text model, whose config
# sits in text_config with only what differs from Gemma3TextConfig's defaults (below)
MULTIMODAL_WRAPPERS = {"gemma3": "gemma3_text"}
_TEXT_DEFAULTS = {
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
    }
}
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn", "longrope")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": one of ROPE_TYPES, ...}; None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    # False for a checkpoint without an LM head (a base model saved for embeddings, as
    # Qwen3-Embedding's): it makes embeddings only (engine/pooling.py)
    generates: bool = True
    # a *ForSequenceClassification checkpoint's labels: its score head (score.weight), of one
    # for a reranker, of more for a classifier (engine/scoring.py); 0 for a causal LM
    num_labels: int = 0
    labels: tuple[str, ...] = ()  # their names (id2label), as /classify answers them
    multi_label: bool = False  # problem_type multi_label_classification: a sigmoid for each
    # the embeddings' pooling the model declares (a GGUF's {arch}.pooling_type; an encoder's CLS)
    # where no sentence-transformers module names one
    pooling: str | None = None
    qkv_bias: bool = False  # q, k and v projections with a bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3)
    qk_norm_whole: bool = False  # that norm over all of q's (and k's) heads at once (OLMoE)
    clip_qkv: float | None = None  # q, k (after their norms) and v clamped to +-clip_qkv (OLMoE)
    # A sliding window: a query at position p sees keys p - sliding_window < k <= p on the layers
    # window_layers marks (None: every layer; Qwen's configs slide only their upper layers).
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] | None = None
    # Gemma 3: its norms hold w - 1 (norm_offset 1 is added as they load: the same (1 + w) x),
    # embeddings scaled by sqrt(hidden), a norm on the attention's and the MLP's outputs too
    # (sandwich_norms), GELU (tanh) in place of SiLU, q . k scaled by query_pre_attn_scalar^-0.5
    # instead of head_dim^-0.5, and the sliding layers' RoPE of its own base (local_rope_theta).
    norm_offset: float = 0.0
    embed_scale: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh"
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    # Gemma 2's soft-capping: attention scores s become attn_softcap tanh(s / attn_softcap), and
    # the logits the same with final_softcap (None: none)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # RoPE turns only the first rotary_dim dims of each head (None: all; Phi-4-mini: 3/4 of them)
    rotary_dim: int | None = None
    # the layers that rotate q and k at all (None: every one; SmolLM3's NoPE layers do not)
    rope_layers: tuple[bool, ...] | None = None
    # Granite's multipliers: of the embeddings, of each layer's attention and MLP outputs before
    # their residual adds, q . k's scale (in place of head_dim^-0.5), and the logits' divisor
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE, OLMoE) in place of the MLP
    # on the layers moe_layers marks (None: every layer, when num_experts > 0): each token runs
    # the experts_per_token experts its router scores highest, weighted by their softmax
    # probabilities (renormalised over the chosen when norm_topk_prob; GraniteMoE's softmax is
    # over the chosen logits alone: softmax_over_chosen), rounded to the model's dtype before
    # they scale an expert's output (Mixtral's stay float32: float_routing_weights), plus
    # Qwen2-MoE's shared expert (shared_expert_size > 0), gated by a sigmoid. expert_names: the
    # checkpoint's naming (EXPERT_NAMES).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_size: int = 0
    moe_layers: tuple[bool, ...] | None = None
    softmax_over_chosen: bool = False
    float_routing_weights: bool = False
    expert_names: str = "qwen"
    # An encoder (model/encoder.py), "bert" (BERT, RoBERTa, XLM-RoBERTa; "distilbert": the same
    # layers, a classifier's head of ReLU where BERT's is tanh) or "modernbert": every
    # token sees its whole prompt. It makes embeddings, or as a classifier (num_labels) scores.
    # BERT's positions are learned embeddings from position_offset on (RoBERTa's pad id + 1),
    # LayerNorm (of rms_norm_eps) after each block, a plain MLP (hidden_act "gelu" or
    # "gelu_tanh") and biases everywhere; a BERT classifier reads a pair's second text as token
    # type 1: every token after its prompt's first sep_token_id (as its tokenizer marks a pair:
    # filled in by the loader). ModernBERT's: RoPE (rope_theta; local_rope_theta on its window
    # layers, where a token sees those within sliding_window of it either way), LayerNorm
    # before each block and at the end, a GeGLU MLP, no biases. "gemma3" (EmbeddingGemma): Gemma
    # 3's text model with every layer attending both ways (its window layers to the keys closer
    # than sliding_window either way: config.json's halved, plus one, as transformers reads it),
    # mean-pooled unless its sentence-transformers modules say more.
    encoder: str = ""
    position_offset: int = 0
    sep_token_id: int | None = None

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rotary_dim == self.head_dim:
            self.rotary_dim = None
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ConfigError(
                f"RoPE over {self.rotary_dim} of {self.head_dim} dimensions a head: "
                "needs an even number, at least 2 (partial_rotary_factor)"
            )
        scaling = self.rope_scaling
        if scaling is not None:
            kind = scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ConfigError(
                    f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})"
                )
            if kind == "default":
                self.rope_scaling = None
            if kind == "yarn":  # served up to the original length x factor (as vLLM does)
                key = "original_max_position_embeddings"
                old = scaling[key] = scaling.get(key) or self.max_position_embeddings
                stretched = int(old * (scaling.get("factor") or 1.0))
                self.max_position_embeddings = max(self.max_position_embeddings, stretched)
            if kind == "longrope":
                self._check_longrope(scaling)
        self._check_moe()
        if self.rope_layers is not None:
            if len(self.rope_layers) != self.num_hidden_layers:
                raise ConfigError(
                    f"{len(self.rope_layers)} entries in no_rope_layers for "
                    f"{self.num_hidden_layers} layers"
                )
            if all(self.rope_layers):
                self.rope_layers = None
        window, layers = self.sliding_window, self.window_layers
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ConfigError(f"sliding_window must be a positive whole number, got {window!r}")
        if layers is not None and len(layers) != self.num_hidden_layers:
            raise ConfigError(
                f"{len(layers)} layer types for {self.num_hidden_layers} layers (layer_types)"
            )
        if window is None or (layers is not None and not any(layers)):
            self.sliding_window, self.window_layers = None, None
        for name in (
            "embedding_multiplier",
            "residual_multiplier",
            "attention_multiplier",
            "logits_scaling",
        ):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and 0 < value < float("inf")
            ):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("attn_softcap", "final_softcap", "clip_qkv"):
            cap = getattr(self, name)
            if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < float("inf")):
                raise ConfigError(f"{name} must be a positive number, got {cap!r}")

    def _check_longrope(self, scaling: dict) -> None:
        """Phi-3's LongRoPE: a factor for each frequency, one set for contexts up to the original
        length and one for longer ones (`use_long_rope` picks; see there)."""
        pairs = self.rope_dim // 2
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not (
                isinstance(factors, list)
                and len(factors) == pairs
                and all(isinstance(f, (int, float)) and 0 < f < float("inf") for f in factors)
            ):
                raise ConfigError(
                    f"longrope {key} must be {pairs} positive numbers (one per rotated pair)"
                )
        old = scaling.get("original_max_position_embeddings")
        if not isinstance(old, int) or old < 1:
            raise ConfigError("longrope needs original_max_position_embeddings")
        scaling.setdefault("long", self.max_position_embeddings > old)

    def layer_moe(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has experts in place of its MLP."""
        return self.num_experts > 0 and (self.moe_layers is None or self.moe_layers[layer])

    def _check_moe(self) -> None:
        if self.num_experts <= 0:
            self.num_experts, self.moe_layers = 0, None
            return
        checks = {
            "num_experts_per_tok": (self.experts_per_token, self.num_experts),
            "moe_intermediate_size": (self.moe_intermediate_size, None),
        }
        for name, (value, most) in checks.items():
            if not isinstance(value, int) or value < 1 or (most is not None and value > most):
                within = f" (at most num_experts, {most})" if most is not None else ""
                raise ConfigError(f"{name} must be a positive whole number{within}, got {value!r}")
        if self.moe_layers is not None and all(self.moe_layers):
            self.moe_layers = None

    def layer_rope(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) rotates its q and k."""
        return self.rope_layers is None or self.rope_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based), None where it attends to everything."""
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return self.sliding_window

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face config.json (old `rope_scaling` and new `rope_parameters` styles)."""
        d = text_model_dict(d)
        model_type = d.get("model_type")
        if model_type == "modernbert":
            return cls._modernbert(d)
        if model_type in ENCODER_MODEL_TYPES:
            return cls._encoder(d)
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = ", ".join(d.get("architectures") or []) or model_type
            raise ConfigError(
                f"unsupported architecture {archs!r}: pagedkv runs Llama-family models "
                f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)}) and encoders "
                f"({', '.join(ENCODER_MODEL_TYPES)})"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ConfigError(f"unsupported model option {flag}=true")
        gemma = model_type in GEMMA
        expected = "gelu_pytorch_tanh" if gemma else "silu"
        act = d.get("hidden_activation") or d.get("hidden_act") or expected
        if model_type == "gemma" and act == "gelu":  # (Gemma's first files: meant the tanh GELU)
            act = "gelu_pytorch_tanh"
        if act != expected:
            raise ConfigError(f"unsupported activation {act!r} for model_type {model_type!r}")
        softcaps: dict[str, Any] = {}
        if model_type in GEMMA_WINDOW_PATTERN:  # Gemma 2's soft-capping (Gemma 3 reads it too)
            gemma2 = model_type == "gemma2"
            softcaps = {
                "attn_softcap": d.get("attn_logit_softcapping", 50.0 if gemma2 else None),
                "final_softcap": d.get("final_logit_softcapping", 30.0 if gemma2 else None),
            }
        else:
            for flag in ("final_logit_softcapping", "attn_logit_softcapping"):
                if d.get(flag):
                    raise ConfigError(f"unsupported model option {flag}={d[flag]}")
        # EmbeddingGemma: Gemma 3's text model attending both ways, an encoder (model/encoder.py)
        bidirectional: dict[str, Any] = {}
        window = _sliding_window(d)
        if d.get("use_bidirectional_attention"):
            if model_type != "gemma3_text":
                raise ConfigError(
                    "unsupported model option use_bidirectional_attention=true (read for Gemma "
                    "3's text model, EmbeddingGemma)"
                )
            bidirectional = {"encoder": "gemma3", "generates": False, "pooling": "MEAN"}
            if window:  # as transformers reads it: half the window either way, and the token
                window["sliding_window"] = window["sliding_window"] // 2 + 1
        # transformers 5 keeps RoPE in `rope_parameters` (Gemma 3's by layer type); older files
        # have rope_theta + rope_scaling, and a legacy rope_scaling wins where both appear (as in
        # transformers)
        params = d.get("rope_parameters") or {}
        by_type = {"full_attention", "sliding_attention"} & set(params)
        local = params.get("sliding_attention") or {} if by_type else {}
        rope = {**(params.get("full_attention") or {} if by_type else params)}
        rope.update(d.get("rope_scaling") or {})
        if "type" in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type") in ("su", "longrope"):  # ("su": Phi-3's first name for it)
            rope["rope_type"] = "longrope"
            key = "original_max_position_embeddings"
            rope.setdefault(key, d.get(key))
        gemma3 = model_type == "gemma3_text"
        default_theta = _DEFAULT_THETA.get(model_type, 10000.0)
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", default_theta)
        gemma_args: dict[str, Any] = {}
        if gemma3:
            if local.get("rope_type", local.get("type", "default")) != "default":
                raise ConfigError(f"unsupported RoPE for sliding layers: {local}")
            local_theta = local.get("rope_theta") or d.get(
                "rope_local_base_freq", GEMMA_LOCAL_ROPE_THETA
            )
            gemma_args = {"local_rope_theta": float(local_theta)}
        if model_type in GEMMA_WINDOW_PATTERN:  # (Gemma 1 scales by head_dim, as Llama does)
            gemma_args["query_pre_attn_scalar"] = float(d.get("query_pre_attn_scalar", 256))
        partial = rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor", 1.0)
        if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
        flags = dict(MODEL_TYPES[model_type])
        if model_type == "qwen2_moe":  # (its q/k/v biases can be turned off)
            flags["qkv_bias"] = bool(d.get("qkv_bias", True))
        try:
            heads = d["num_attention_heads"]
            head_dim = d.get("head_dim") or d["hidden_size"] // heads
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=rope or None,
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=d.get("tie_word_embeddings", gemma),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                rotary_dim=int(head_dim * partial),  # (as transformers rounds it)
                rope_layers=_rope_layers(d),
                **_classifier(d),
                clip_qkv=d.get("clip_qkv") if model_type == "olmoe" else None,
                **_granite(d),
                **experts_of(d),
                **window,
                **gemma_args,
                **softcaps,
                **flags,
                **bidirectional,
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks {e.args[0]!r}") from None

    @classmethod
    def _encoder(cls, d: dict[str, Any]) -> LlamaConfig:
        """A BERT, RoBERTa, XLM-RoBERTa or DistilBERT config.json (a base model, or a classifier:
        a cross-encoder, *ForSequenceClassification): pooled CLS where no sentence-transformers
        module says otherwise (as vLLM pools them); the context is its position table's, less
        RoBERTa's offset."""
        distil = d.get("model_type") == "distilbert"
        if distil:  # (BERT's layers under other names, no token types, LayerNorms of 1e-12)
            d = {
                **d,
                **{ours: d[theirs] for theirs, ours in _DISTILBERT_NAMES.items() if theirs in d},
            }
        act = d.get("hidden_act", "gelu")
        if act not in ENCODER_ACTIVATIONS:
            raise ConfigError(
                f"unsupported activation {act!r} for an encoder ({', '.join(ENCODER_ACTIVATIONS)})"
            )
        positions = d.get("position_embedding_type", "absolute")
        if positions != "absolute":
            raise ConfigError(
                f"unsupported position_embedding_type {positions!r} (absolute position embeddings)"
            )
        offset = (
            0
            if d.get("model_type") in ("bert", "distilbert")
            else int(d.get("pad_token_id", 1)) + 1
        )
        return cls(
            **_encoder_shape(d),
            rms_norm_eps=d.get("layer_norm_eps", 1e-12),
            rope_theta=0.0,
            max_position_embeddings=d.get("max_position_embeddings", 512) - offset,
            pooling="CLS",
            qkv_bias=True,
            hidden_act=ENCODER_ACTIVATIONS[act],
            encoder="distilbert" if distil else "bert",
            position_offset=offset,
        )

    @classmethod
    def _modernbert(cls, d: dict[str, Any]) -> LlamaConfig:
        """A ModernBERT config.json, as transformers 5 writes it (layer_types, rope_parameters)
        or as the published checkpoints do (global_attn_every_n_layers, global_rope_theta,
        local_rope_theta); a classifier pools as its classifier_pooling says."""
        for flag in ("attention_bias", "mlp_bias", "norm_bias", "classifier_bias"):
            if d.get(flag):
                raise ConfigError(f"unsupported model option {flag}=true")
        for key in ("hidden_activation", "classifier_activation"):
            if d.get(key, "gelu") != "gelu":
                raise ConfigError(f"unsupported {key} {d[key]!r} for ModernBERT (gelu)")
        shape = _encoder_shape(d)
        types = d.get("layer_types")
        every = d.get("global_attn_every_n_layers", 3)
        local = (
            tuple(t == "sliding_attention" for t in types)
            if types
            else tuple(bool(i % every) for i in range(shape["num_hidden_layers"]))
        )
        rope = d.get("rope_parameters") or {}
        full = (rope.get("full_attention") or {}).get("rope_theta")
        near = (rope.get("sliding_attention") or {}).get("rope_theta")
        mean = shape["num_labels"] and d.get("classifier_pooling", "cls") == "mean"
        return cls(
            **shape,
            rms_norm_eps=d.get("norm_eps", 1e-5),
            rope_theta=float(full or d.get("global_rope_theta", 160000.0)),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            pooling="MEAN" if mean else "CLS",
            hidden_act="gelu",
            local_rope_theta=float(near or d.get("local_rope_theta", 10000.0)),
            sliding_window=d.get("local_attention", 128) // 2,
            window_layers=local,
            encoder="modernbert",
        )


def _encoder_shape(d: dict[str, Any]) -> dict[str, Any]:
    """What every encoder's LlamaConfig holds alike: its sizes (as many K/V heads as heads), no
    LM head (embeddings, or a classifier's labels, _classifier), no RoPE scaling."""
    try:
        hidden, heads = d["hidden_size"], d["num_attention_heads"]
        shape = dict(
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=hidden // heads,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
    if hidden % heads:
        raise ConfigError(f"hidden_size {hidden} is not a multiple of {heads} heads")
    return {
        **shape,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "generates": False,
        "num_labels": 0,
        **_classifier(d),
    }


def _classifier(d: dict[str, Any]) -> dict[str, Any]:
    """A sequence classifier's labels (transformers' num_labels: id2label's, else 2), their names
    (transformers' LABEL_i where id2label has none) and whether they are independent."""
    archs = d.get("architectures") or []
    if not (archs and str(archs[0]).endswith("ForSequenceClassification")):
        return {}
    names = d.get("id2label") or {}
    n = len(names) or d.get("num_labels", 2)
    if not (isinstance(n, int) and n > 0 and isinstance(names, dict)):
        raise ConfigError(f"a classifier's num_labels must be a positive int, got {n!r}")
    return {
        "num_labels": n,
        "labels": tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(n)),
        "multi_label": d.get("problem_type") == "multi_label_classification",
    }


def use_long_rope(config: LlamaConfig, max_model_len: int) -> None:
    """LongRoPE's factor set for the context served: the long one when it exceeds the original
    length. Fixed for the engine's life, as vLLM and llama.cpp fix it, so that a token's K/V do
    not depend on what else runs, on chunking, preemption or a cached prefix. (transformers
    switches per forward, by the longest sequence: equal to this wherever every sequence stays
    within the original length and max_model_len does, or exceeds it from its prompt on.)"""
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type") == "longrope":
        scaling["long"] = max_model_len > scaling["original_max_position_embeddings"]


def text_model_dict(d: dict[str, Any]) -> dict[str, Any]:
    """config.json as the text model's own: a multimodal wrapper's text_config (with the wrapper's
    token ids and tying, which transformers takes from the wrapper), and the defaults transformers
    fills in where a Gemma 3 file leaves keys out."""
    if d.get("model_type") in MULTIMODAL_WRAPPERS:
        text = d.get("text_config") or {}
        if not isinstance(text, dict):
            raise ConfigError("config.json: text_config must be an object")
        keys = ("bos_token_id", "eos_token_id", "tie_word_embeddings")
        outer = {k: d[k] for k in keys if d.get(k) is not None}
        d = {**text, **outer, "model_type": MULTIMODAL_WRAPPERS[d["model_type"]]}
    return {**_TEXT_DEFAULTS.get(d.get("model_type", ""), {}), **d}


def _granite(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers, with GraniteConfig's defaults (attention_multiplier 1.0, not
    head_dim^-0.5); none for every other family."""
    if d.get("model_type") not in ("granite", "granitemoe"):
        return {}
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {k: d.get(k, 1.0) for k in keys}


def experts_of(d: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' shape: Mixtral's and GraniteMoE's (num_local_experts as wide as the
    MLP, every layer, renormalised), OLMoE's (the same, not renormalised unless it says so) or
    Qwen's (num_experts; layers from decoder_sparse_step and mlp_only_layers, as transformers
    picks them); none for a dense model."""
    model_type = d.get("model_type")
    if model_type in ("mixtral", "granitemoe", "olmoe"):  # (experts as wide as intermediate_size)
        olmoe = model_type == "olmoe"
        return {
            "num_experts": d.get("num_experts", d.get("num_local_experts", 64 if olmoe else 8)),
            "experts_per_token": d.get("num_experts_per_tok", 8 if olmoe else 2),
            "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)) if olmoe else True,
        }
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return {}
    defaults = _QWEN_MOE_DEFAULTS[model_type]
    # (transformers 5 writes num_experts as num_local_experts, Mixtral's name)
    experts = d.get("num_experts", d.get("num_local_experts", defaults[0]))
    step = d.get("decoder_sparse_step", 1)
    dense = d.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step must be a positive whole number, got {step!r}")
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ConfigError("mlp_only_layers must be a list of layer numbers")
    return {
        "num_experts": experts,
        "experts_per_token": d.get("num_experts_per_tok", defaults[1]),
        "moe_intermediate_size": d.get("moe_intermediate_size", defaults[2]),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        "shared_expert_size": d.get("shared_expert_intermediate_size", defaults[3]),
        "moe_layers": tuple(
            i not in dense and (i + 1) % step == 0 for i in range(d["num_hidden_layers"])
        ),
    }


# transformers' defaults where a Qwen MoE config.json leaves a key out: (experts, experts per
# token, expert size, shared expert size)
_QWEN_MOE_DEFAULTS = {"qwen2_moe": (60, 4, 1408, 5632), "qwen3_moe": (128, 8, 768, 0)}


def _rope_layers(d: dict[str, Any]) -> tuple[bool, ...] | None:
    """SmolLM3's layers that rotate q and k (no_rope_layers: 1 where they do), by default all but
    every no_rope_layer_interval-th (transformers' rule); None for every other family."""
    if d.get("model_type") != "smollm3":
        return None
    listed = d.get("no_rope_layers")
    if listed is None:
        every = d.get("no_rope_layer_interval", 4)
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"no_rope_layer_interval must be a positive whole number: {every!r}")
        return all_but_every_nth(d["num_hidden_layers"], every)
    if not isinstance(listed, list) or not all(x in (0, 1) for x in listed):
        raise ConfigError("no_rope_layers must be a list of 0 and 1 (1: the layer uses RoPE)")
    return tuple(bool(x) for x in listed)


def _sliding_window(d: dict[str, Any]) -> dict[str, Any]:
    """config.json's sliding window as transformers reads it: Mistral's and Phi-3's on every layer;
    Qwen's only with use_sliding_window, on the layers from max_window_layers on, unless
    layer_types names them."""
    qwen = d.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    windowed = ("mistral", *GEMMA_WINDOW_PATTERN)
    window = d.get("sliding_window", 4096 if d.get("model_type") in windowed else None)
    opt_in = qwen or d.get("model_type") == "smollm3"  # (their use_sliding_window: off)
    if not window or not d.get("use_sliding_window", not opt_in):
        return {}
    types = d.get("layer_types")
    if types is not None:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ConfigError(f"unsupported layer types {sorted(unknown)} (layer_types)")
        return {
            "sliding_window": window,
            "window_layers": tuple(t != "full_attention" for t in types),
        }
    if qwen:
        lowest = d.get("max_window_layers", 28)
        layers = tuple(i >= lowest for i in range(d["num_hidden_layers"]))
        return {"sliding_window": window, "window_layers": layers}
    if d.get("model_type") == "smollm3":  # (its NoPE layers slide)
        layers = tuple(not rope for rope in _rope_layers(d) or ())
        return {"sliding_window": window, "window_layers": layers}
    pattern = GEMMA_WINDOW_PATTERN.get(d.get("model_type", ""))
    if pattern:
        pattern = d.get("sliding_window_pattern", pattern)
        layers = all_but_every_nth(d["num_hidden_layers"], pattern)
        return {"sliding_window": window, "window_layers": layers}
    return {"sliding_window": window}


def all_but_every_nth(layers: int, n: int) -> tuple[bool, ...]:
    """True for every layer but each n-th (1-based): Gemma 2's and 3's window layers where no
    layer_types are given (every n-th attends to all), SmolLM3's RoPE layers (every n-th has
    none)."""
    return tuple(bool((i + 1) % n) for i in range(layers))


@dataclass
class Checkpoint:
    """What a loader found in a model file or folder, before any tensor is built."""

    config: LlamaConfig
    tokenizer: Tokenizer
    weights: Iterator[tuple[str, Tensor | Blocks]]  # (HF name, tensor or GGUF blocks), lazily
    files: list[Path]  # what the weights' identity is hashed from
    max_model_len: int

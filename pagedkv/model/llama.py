"""Llama-family forward over a flat, varlen batch with a paged KV cache.

Inference only. A step's new tokens of all sequences are concatenated into
T rows; `positions` says where each sits in its sequence, the attention
metadata says where its K/V goes and what it reads. To keep the number of
torch ops per layer small, q/k/v are one fused weight and gate/up another
(built at load time from the Hugging Face tensors), and the work between the
matmuls is one call each: the residual add with RMSNorm and SiLU with the up
projection's product (ops.py), RoPE with the K/V store (attention/store.py,
from the rotary tables built here; Qwen2's q/k/v bias and Qwen3's per-head q/k
norms go into the same call). Gemma adds GELU in SiLU's place and scaled
embeddings; Gemma 2 a norm on the attention's and the MLP's outputs and
soft-capped scores and logits; Gemma 3 a second set of rotary tables for its
window layers (model/config.py). Phi-4-mini turns only part of each head,
SmolLM3 leaves some layers unturned (a RoPE call without tables), and Granite
scales the residual adds inside the norm's call. The matmul weights may
be quantized (--quantization, quant_linear.py): `linear` takes either form.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from pagedkv.attention.paged import AttentionMetadata, Cache, paged_attention
from pagedkv.attention.store import QKNorm, rope_and_store
from pagedkv.config import QUANTIZATIONS, ConfigError
from pagedkv.model import ops
from pagedkv.model.config import EXPERT_NAMES, LlamaConfig
from pagedkv.model.moe import Expert, SparseMoE
from pagedkv.model.prepacked import PrepackedWeight, prepack
from pagedkv.model.quant_linear import (
    Blocks,
    Int8Weight,
    QuantWeight,
    Weight,
    embed,
    frozen,
    gguf_weight,
    linear,
    weight_nbytes,
)

if TYPE_CHECKING:
    from pagedkv.model.lora import LoRABatch

MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")


def rope_inv_freq(config: LlamaConfig) -> tuple[Tensor, float]:
    """Per-pair rotation frequencies [rope_dim / 2], with the model's scaling applied, and the
    factor cos and sin are scaled by (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
    dim = config.rope_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":  # (transformers' expression, to the last bit)
        ext = torch.tensor(scaling["long_factor" if scaling["long"] else "short_factor"])
        return 1.0 / (ext * config.rope_theta**exponents), _longrope_attention(config, scaling)
    if kind == "yarn":
        return _yarn(inv_freq, config.rope_theta, dim, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "freq_factors":  # GGUF's rope_freqs tensor (how llama.cpp stores llama3 scaling)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        blend = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - blend) * inv_freq / factor + blend * inv_freq, 1.0
    return inv_freq, 1.0


def _longrope_attention(config: LlamaConfig, s: dict) -> float:
    """LongRoPE's scale of cos and sin: the model's attention_factor, else sqrt(1 + ln f / ln L)
    for the context's stretch f over the original length L (both factor sets alike)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))


def _yarn(inv_freq: Tensor, base: float, dim: int, s: dict) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by the factor), those that
    turn more than beta_fast times kept, a linear ramp between; cos and sin scaled by
    0.1 ln(factor) + 1 (or the model's own attention_factor / mscale pair)."""
    factor, old_len = s.get("factor") or 1.0, s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turns_dim(turns: float) -> float:  # the dimension whose pair turns `turns` times
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(s.get("beta_fast") or 32), turns_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # 1 for the fast-turning pairs (extrapolated), 0 for the slow (interpolated)
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)


class Rotary(nn.Module):
    """RoPE tables by position (float32 [P, R] for the R = rope_dim leading dims of a head that
    turn, HF's layout: their two halves rotate together), rotate_half's sign folded into sin;
    attention/store.py applies them."""

    cos: Tensor  # buffers (declared for mypy: nn.Module's __getattr__ types them loosely)
    sin: Tensor

    def __init__(self, config: LlamaConfig, context: int, local: bool = False) -> None:
        """context: the positions served (--max-model-len: a model of 131,072 positions served
        to 8,192 keeps 16x smaller tables; Gemma 3 4B's two sets at full length are 0.5 GiB).
        local: the tables of Gemma 3's sliding layers (plain RoPE of local_rope_theta)."""
        super().__init__()
        positions = torch.arange(context, dtype=torch.float32)
        if local:
            assert config.local_rope_theta is not None
            config = replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        inv_freq, scale = rope_inv_freq(config)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # [P, R]
        half = config.rope_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * sign * scale, persistent=False)


class RMSNorm(nn.Module):
    """A norm's weight and epsilon (ops.rms_norm applies them)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = frozen(size, dtype=dtype)
        self.eps = eps


@dataclass(slots=True)
class ForwardBuffers:
    """Where one forward's layers write their results, the same tensors in every layer (a layer
    reads its input before it overwrites the buffer it came in): a forward allocates these six
    instead of eight tensors a layer, and a decode graph (decode_graph.py) records its kernels
    writing at fixed addresses. Kernels that cannot write into them return new tensors."""

    h: Tensor  # [T, hidden] the norms' outputs (and the forward's result)
    qkv: Tensor  # [T, (Hq + 2 Hkv) D]
    attn: Tensor  # [T, Hq, D]
    o: Tensor  # [T, hidden] o_proj's and down_proj's outputs: the layer's output
    gate_up: Tensor  # [T, 2 I]
    act: Tensor  # [T, I]

    @classmethod
    def of(cls, model: LlamaForCausalLM, tokens: int) -> ForwardBuffers:
        layers = [cast(DecoderLayer, layer) for layer in model.layers]
        layer = layers[0]
        qkv = layer._weights[1]
        # (the MLP's: a mixture of experts' layers make their own)
        gate_up = next((d._weights[4] for d in layers if d._weights[4] is not None), None)
        hidden, inter = model.config.hidden_size, 2 if gate_up is None else gate_up.shape[0]

        def empty(*shape: int) -> Tensor:
            return torch.empty(tokens, *shape, dtype=model.dtype)

        return cls(
            empty(hidden),
            empty(qkv.shape[0]),
            empty(layer.num_heads, layer.head_dim),
            empty(hidden),
            empty(inter),
            empty(inter // 2),
        )

    def rows(self, tokens: int) -> ForwardBuffers:
        """The first `tokens` rows of each (contiguous views): buffers for a shorter forward."""
        return ForwardBuffers(
            self.h[:tokens],
            self.qkv[:tokens],
            self.attn[:tokens],
            self.o[:tokens],
            self.gate_up[:tokens],
            self.act[:tokens],
        )


class DecoderLayer(nn.Module):
    # set by refresh_weights in __dict__ (declared for mypy): norm1, qkv, o, norm2, gate_up, down
    # (the MLP's: None where experts replace it)
    _weights: tuple[
        Tensor,
        Weight,
        Weight,
        Tensor,
        Weight | None,
        Weight | None,
    ]
    _qkv_bias: Tensor | None
    _qk_norm: QKNorm | None
    _whole_qk_norm: QKNorm | None
    _out_norms: tuple[Tensor, Tensor] | None
    all_reduce: Callable[[Tensor], None] | None

    def __init__(
        self,
        config: LlamaConfig,
        dtype: torch.dtype,
        device: str | None = None,
        window: int | None = None,
        experts: bool = False,
    ) -> None:
        """window: this layer's sliding window (None: the whole context); experts: a mixture of
        experts in place of the MLP."""
        super().__init__()
        c = config
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.scale = c.attention_multiplier or (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self.residual_scale = c.residual_multiplier  # (Granite's: on o and down before the adds)
        self.softcap = c.attn_softcap or 0.0  # Gemma 2's soft-capped scores
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        # before the MLP (Gemma's pre_feedforward_layernorm)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.sandwich_norms:  # Gemma's on the attention's and the MLP's outputs
            self.attn_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.mlp_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.act = ops.gelu_tanh_mul if c.hidden_act == "gelu_tanh" else ops.silu_mul
        self.qkv_proj = frozen(
            self.q_size + 2 * self.kv_size, c.hidden_size, dtype=dtype, device=device
        )
        self.o_proj = frozen(c.hidden_size, self.q_size, dtype=dtype, device=device)
        self.moe = SparseMoE(c, dtype, device) if experts else None
        if not experts:
            self.gate_up_proj = frozen(
                2 * c.intermediate_size, c.hidden_size, dtype=dtype, device=device
            )
            self.down_proj = frozen(c.hidden_size, c.intermediate_size, dtype=dtype, device=device)
        if c.qkv_bias:
            self.qkv_bias = frozen(self.q_size + 2 * self.kv_size, dtype=dtype)
        if c.qk_norm:  # (over each head, or OLMoE's over all heads at once: qk_norm_whole)
            whole = c.qk_norm_whole
            self.q_norm = RMSNorm(self.q_size if whole else c.head_dim, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.kv_size if whole else c.head_dim, c.rms_norm_eps, dtype)
        self.clip_qkv = c.clip_qkv
        self.eps = c.rms_norm_eps
        self.refresh_weights()

    def refresh_weights(self) -> None:
        """Plain references for forward: nn.Module finds parameters through a slow __getattr__, a
        cost paid ~10 times per layer per step. (Parameter objects stay the same when weights are
        loaded or the module is moved: their data changes in place; a quantized weight replaces
        its parameter, so loading calls this again.)"""
        self.__dict__["_weights"] = (
            self.input_layernorm.weight,
            self.qkv_proj,
            self.o_proj,
            self.post_attention_layernorm.weight,
            getattr(self, "gate_up_proj", None),
            getattr(self, "down_proj", None),
        )
        if self.moe is not None:
            self.moe.refresh_weights()
        self.__dict__["_qkv_bias"] = getattr(self, "qkv_bias", None)
        self.__dict__["_out_norms"] = (
            (self.attn_out_norm.weight, self.mlp_out_norm.weight)
            if hasattr(self, "attn_out_norm")
            else None
        )
        qk_norm = (
            QKNorm(self.q_norm.weight, self.k_norm.weight, self.eps)
            if hasattr(self, "q_norm")
            else None
        )
        whole = qk_norm is not None and qk_norm.q.numel() != self.head_dim
        self.__dict__["_qk_norm"] = None if whole else qk_norm  # (per head: in the RoPE kernel)
        self.__dict__["_whole_qk_norm"] = qk_norm if whole else None
        # Tensor parallelism (distributed/shard.py) sets this: it sums the ranks' partial outputs
        # of o_proj and down_proj in place.
        self.__dict__["all_reduce"] = None

    def _norm_and_clip(self, qkv: Tensor) -> Tensor:
        """OLMoE's q and k norms, each over all its heads at once, then q, k and v clamped to
        +-clip_qkv, in place (in torch: a mixture of experts runs eagerly anyway)."""
        norm = self._whole_qk_norm
        if norm is not None:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q.copy_(ops.rms_norm(q.contiguous(), norm.q, norm.eps)[0])
            k.copy_(ops.rms_norm(k.contiguous(), norm.k, norm.eps)[0])
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        rotary: Rotary | None,
        positions: Tensor,
        kv_cache: tuple[Cache, Cache],
        meta: AttentionMetadata,
        buf: ForwardBuffers,
        lora: tuple[LoRABatch, int] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The layer's output still to be added to the residual stream, and that stream so far
        (vLLM's layout: the add is fused into the next norm). `lora`: the step's adapters and
        this layer's index."""
        norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj = self._weights
        tokens = x.shape[0]
        h, residual = ops.rms_norm(x, norm1, self.eps, residual, buf.h, self.residual_scale)
        qkv = linear(h, qkv_proj, buf.qkv)
        if lora is not None:
            lora[0].add(lora[1], "qkv", h, qkv)
        if self._whole_qk_norm is not None or self.clip_qkv is not None:
            qkv = self._norm_and_clip(qkv)
        q = rope_and_store(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            positions,
            None if rotary is None else rotary.cos,
            None if rotary is None else rotary.sin,
            kv_cache,
            meta.slot_mapping,
            self._qkv_bias,
            self._qk_norm,
        )
        attn = paged_attention(q, *kv_cache, meta, self.scale, buf.attn, self.window, self.softcap)
        o = linear(attn.reshape(tokens, self.q_size), o_proj, buf.o)
        if lora is not None:
            lora[0].add(lora[1], "o", attn.reshape(tokens, self.q_size), o)
        reduce = self.all_reduce
        if reduce is not None:
            reduce(o)
        out_norms = self._out_norms
        if out_norms is not None:
            o = ops.rms_norm(o, out_norms[0], self.eps, None, o)[0]
        h, residual = ops.rms_norm(o, norm2, self.eps, residual, buf.h, self.residual_scale)
        if self.moe is not None:
            out = self.moe.forward(h, self.act, buf.o)
        else:
            assert gate_up_proj is not None and down_proj is not None  # (a dense MLP's)
            gate_up = linear(h, gate_up_proj, buf.gate_up)
            if lora is not None:
                lora[0].add(lora[1], "gate_up", h, gate_up)
            act = self.act(gate_up, buf.act)
            out = linear(act, down_proj, buf.o)
            if lora is not None:
                lora[0].add(lora[1], "down", act, out)
        if reduce is not None:
            reduce(out)
        if out_norms is not None:
            out = ops.rms_norm(out, out_norms[1], self.eps, None, out)[0]
        return out, residual


_LAYER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# HF sub-names of one layer's weights -> (our fused parameter, its part index)
FUSED_PARTS = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
    "self_attn.o_proj": ("o_proj", 0),
    "mlp.down_proj": ("down_proj", 0),
    "input_layernorm": ("input_layernorm.weight", 0),
    "post_attention_layernorm": ("post_attention_layernorm.weight", 0),
}
# checkpoints that hold q/k/v and gate/up fused already, as we do (Phi-3's)
FUSED_WHOLE = {"self_attn.qkv_proj": "qkv_proj", "mlp.gate_up_proj": "gate_up_proj"}
# the same for the parts only some Llama-family models have, by the config flag that says so
OPTIONAL_PARTS = {
    "qkv_bias": {
        "self_attn.q_proj.bias": ("qkv_bias", 0),
        "self_attn.k_proj.bias": ("qkv_bias", 1),
        "self_attn.v_proj.bias": ("qkv_bias", 2),
    },
    "qk_norm": {
        "self_attn.q_norm.weight": ("q_norm.weight", 0),
        "self_attn.k_norm.weight": ("k_norm.weight", 0),
    },
    "sandwich_norms": {  # Gemma's post_attention_layernorm is on the attention's output
        "post_attention_layernorm.weight": ("attn_out_norm.weight", 0),
        "pre_feedforward_layernorm.weight": ("post_attention_layernorm.weight", 0),
        "post_feedforward_layernorm.weight": ("mlp_out_norm.weight", 0),
    },
}


def expert_parts(config: LlamaConfig) -> dict[str, tuple[str, int, int]]:
    """A layer's mixture of experts as FUSED_PARTS gives an MLP: HF sub-name -> (our parameter,
    its part, of how many), in the checkpoint's naming (config.expert_names)."""
    moe, router, names = EXPERT_NAMES[config.expert_names]
    parts = {f"{moe}.{router}.weight": ("moe.router", 0, 1)}
    experts = [(f"{moe}.experts.{e}", f"moe.experts.{e}") for e in range(config.num_experts)]
    if config.shared_expert_size:  # (Qwen2-MoE's)
        experts.append((f"{moe}.shared_expert", "moe.shared"))
        parts[f"{moe}.shared_expert_gate.weight"] = ("moe.shared_gate", 0, 1)
    for hf, ours in experts if names else ():  # (GraniteMoE's: STACKED_EXPERTS)
        gate, up, down = (f"{hf}.{name}.weight" for name in names)
        parts[gate] = (f"{ours}.gate_up_proj", 0, 2)
        parts[up] = (f"{ours}.gate_up_proj", 1, 2)
        parts[down] = (f"{ours}.down_proj", 0, 1)
    return parts


# checkpoints that hold each projection of all of a layer's experts in one [experts, out, in]
# tensor: HF sub-name -> each expert's weight (GraniteMoE's: gate and up fused, gate first)
STACKED_EXPERTS = {
    "granite": {
        "block_sparse_moe.input_linear.weight": "gate_up_proj",
        "block_sparse_moe.output_linear.weight": "down_proj",
    }
}

_TOP = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head",
}
_PARTS = {"qkv_proj": 3, "gate_up_proj": 2, "qkv_bias": 3}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        dtype: torch.dtype = torch.float32,
        quantization: str = "none",
        pack: bool = True,
        context: int | None = None,
    ) -> None:
        """quantization: "none", "int8" (per-row int8 of any float weights) or "gguf" (the GGUF
        file's own blocks, which load_weights then receives as quant_linear.Blocks).
        pack=False: GGUF blocks stay as they are until `pack_weights` (tensor parallelism cuts
        them first: the packed layout cannot be cut). context: the positions RoPE serves (None:
        max_position_embeddings)."""
        super().__init__()
        if quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
            )
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        self.pack = pack
        late = None if quantization == "none" else "meta"
        self.embed_tokens = frozen(config.vocab_size, config.hidden_size, dtype=dtype, device=late)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, late, config.layer_window(i), config.layer_moe(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else frozen(config.vocab_size, config.hidden_size, dtype=dtype, device=late)
        )
        # a sequence classifier's head (float32, as vLLM keeps it: a score is one dot product)
        self.score = (
            frozen(config.num_labels, config.hidden_size, dtype=torch.float32)
            if config.num_labels
            else None
        )
        self.score_bias: Tensor | None = None  # its bias, where the checkpoint has one
        self.context = context or config.max_position_embeddings
        self.rotary = Rotary(config, self.context)
        # Gemma 3's sliding layers rotate with tables of their own; each layer's, in order
        self.local_rotary = (
            Rotary(config, self.context, local=True) if config.local_rope_theta else None
        )
        self._rotaries: list[Rotary | None] = [
            None
            if not config.layer_rope(i)  # (SmolLM3's NoPE layers)
            else self.local_rotary
            if self.local_rotary and config.layer_window(i)
            else self.rotary
            for i in range(config.num_hidden_layers)
        ]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Cache, Cache]],
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> Tensor:
        """Hidden states [T, hidden] (after the final norm) of the step's new tokens; `lora`: the
        rows that run under adapters."""
        x = self.embed(input_ids)
        buf = ForwardBuffers.of(self, x.shape[0])
        return self.run_layers(x, positions, kv_caches, meta, buf, lora)

    def embed(self, input_ids: Tensor) -> Tensor:
        """The tokens' embeddings [T, hidden], the first layer's input (Gemma's times
        sqrt(hidden), rounded to the model's dtype first as transformers does)."""
        x = embed(input_ids, self.embed_tokens, self.dtype)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        if self.config.embedding_multiplier != 1.0:  # (Granite's, as transformers multiplies)
            x = x * self.config.embedding_multiplier
        return x

    def run_layers(
        self,
        x: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Cache, Cache]],
        meta: AttentionMetadata,
        buf: ForwardBuffers,
        lora: LoRABatch | None = None,
    ) -> Tensor:
        """The layers and the final norm over embeddings x (which become the residual stream,
        updated in place); the result is in buf.h where the kernels wrote it there."""
        residual = None
        norm = self.norm
        for i, (layer, kv_cache, rotary) in enumerate(zip(self.layers, kv_caches, self._rotaries)):
            x, residual = layer.forward(
                x,
                residual,
                rotary,
                positions,
                kv_cache,
                meta,
                buf,
                None if lora is None else (lora, i),
            )  # (no hooks: saves ~2 us)
        scale = self.config.residual_multiplier
        return ops.rms_norm(x, norm.weight, norm.eps, residual, buf.h, scale)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, vocab] float32 logits of the rows the sampler needs (Gemma 2's soft-capped:
        cap tanh(logits / cap), in the model's dtype as transformers computes them)."""
        logits = linear(hidden, self.lm_head)
        if self.config.logits_scaling != 1.0:  # (Granite's)
            logits = logits / self.config.logits_scaling
        cap = self.config.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def head_rows(self, ids: list[int]) -> Tensor:
        """float32 rows of the LM head (a reranker's classifier is made of them), in whatever
        form it is kept; a tied head's from the embedding, which stays unpacked."""
        w = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if isinstance(w, Tensor):
            return w[ids].float()
        if isinstance(w, PrepackedWeight):
            return w.rows(ids)
        assert not isinstance(w, Blocks)  # (packed when the load ended)
        return w.rows(torch.tensor(ids), torch.float32)

    def _weight_owners(self) -> list[nn.Module]:
        """The modules that hold matmul weights (MATMUL_WEIGHTS): the model, its layers and
        their experts."""
        return [self, *(m for m in self.modules() if isinstance(m, (DecoderLayer, Expert)))]

    def weight_bytes(self) -> int:
        """Resident bytes of all weights (a tied embedding counted once)."""
        found = {id(p): p for p in self.parameters()}
        for owner in self._weight_owners():
            for name in MATMUL_WEIGHTS:
                w = owner.__dict__.get(name)
                if w is not None:
                    found[id(w)] = w
        return sum(weight_nbytes(w) for w in found.values())

    def load_weights(
        self, weights: Mapping[str, Tensor | Blocks] | Iterable[tuple[str, Tensor | Blocks]]
    ) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up.

        Takes a dict or a stream of (name, tensor) pairs; a fused weight is
        written as soon as all its parts have arrived, so a stream never needs
        more than about one layer in memory.
        """
        # HF sub-name -> (our parameter, the part it is, of how many), for a layer with an MLP and
        # for one with experts in its place
        parts_of = {
            f"{hf}.weight": (target, i, _PARTS.get(target, 1))
            for hf, (target, i) in FUSED_PARTS.items()
        }
        for flag, optional in OPTIONAL_PARTS.items():
            if getattr(self.config, flag):
                parts_of.update({k: (t, i, _PARTS.get(t, 1)) for k, (t, i) in optional.items()})
        parts_of.update({f"{hf}.weight": (target, 0, 1) for hf, target in FUSED_WHOLE.items()})
        moe_parts = {k: v for k, v in parts_of.items() if v[0] not in ("gate_up_proj", "down_proj")}
        moe_parts.update(expert_parts(self.config))
        layer_parts = [
            moe_parts if self.config.layer_moe(i) else parts_of for i in range(len(self.layers))
        ]
        stacked = STACKED_EXPERTS.get(self.config.expert_names, {})
        pending: dict[tuple[int, str], list[Tensor | Blocks | None]] = {}
        done: set[str] = set()

        def add(layer: int, target: str, index: int, count: int, tensor: Tensor | Blocks) -> None:
            parts = pending.setdefault((layer, target), [None] * count)
            parts[index] = tensor
            ready = [p for p in parts if p is not None]
            if len(ready) == len(parts):
                full = f"model.layers.{layer}.{target}"
                self._store(self.layers[layer], target, _join(ready), full)
                done.add(full)
                del pending[(layer, target)]

        for name, tensor in weights.items() if isinstance(weights, Mapping) else weights:
            m = _LAYER_WEIGHT.fullmatch(name)
            sub = m and f"{m.group(2)}.{m.group(3)}"
            layer = int(m.group(1)) if m else -1
            if m and layer >= len(self.layers):
                raise ConfigError(
                    f"unexpected weight {name!r}: the model has {len(self.layers)} layers"
                )
            if m and sub in layer_parts[layer]:
                add(layer, *layer_parts[layer][sub], tensor)
            elif m and sub in stacked and self.config.layer_moe(layer):
                if not isinstance(tensor, Tensor) or tensor.shape[0] != self.config.num_experts:
                    raise ConfigError(
                        f"weight {name} has shape {tuple(tensor.shape)}: expected one matrix "
                        f"for each of {self.config.num_experts} experts"
                    )
                for e in range(self.config.num_experts):
                    add(layer, f"moe.experts.{e}.{stacked[sub]}", 0, 1, tensor[e])
            elif name in _TOP:
                if name != "lm_head.weight" or not self.config.tie_word_embeddings:
                    self._store(self, _TOP[name], tensor, name)
                done.add(name)
            elif name == "score.bias" and self.score is not None:
                assert isinstance(tensor, Tensor)  # (no GGUF file has one)
                if tuple(tensor.shape) != (self.config.num_labels,):
                    raise ConfigError(
                        f"weight {name} has shape {tuple(tensor.shape)}, expected "
                        f"({self.config.num_labels},)"
                    )
                self.score_bias = tensor.float()
            elif name == "score.weight" and self.score is not None:
                assert isinstance(tensor, Tensor)  # (no GGUF file has one)
                self._copy(self.score, tensor, name)
                done.add(name)
            elif not name.endswith("rotary_emb.inv_freq"):
                raise ConfigError(f"unexpected weight {name!r} for a Llama model")
        required = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.score is not None:
            required.add("score.weight")
        if not self.config.tie_word_embeddings:
            required.add("lm_head.weight")
        required.update(
            f"model.layers.{i}.{t}"
            for i, parts in enumerate(layer_parts)
            for t, _, _ in parts.values()
        )
        required.update(
            f"model.layers.{i}.moe.experts.{e}.{t}"
            for i in range(len(self.layers))
            if self.config.layer_moe(i)
            for e in range(self.config.num_experts)
            for t in stacked.values()
        )
        missing = sorted(required - done)
        if missing:
            raise ConfigError(
                f"missing weights: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
            )
        if self.config.tie_word_embeddings and not isinstance(self.embed_tokens, nn.Parameter):
            replace_weight(self, "lm_head", self.embed_tokens)
        for decoder in self.layers:
            cast(DecoderLayer, decoder).refresh_weights()

    def _store(self, owner: nn.Module, target: str, value: Tensor | Blocks, name: str) -> None:
        """Copy a weight in, or (quantized model, matmul weight) replace the parameter with its
        quantized form."""
        path, _, leaf = target.rpartition(".")
        if path and leaf in MATMUL_WEIGHTS:  # (an expert's: moe.experts.E.gate_up_proj)
            owner, target = owner.get_submodule(path), leaf
        if self.quantization == "none" or target not in MATMUL_WEIGHTS:
            value = value.dequantize() if isinstance(value, Blocks) else value
            if target.endswith("norm.weight") and self.config.norm_offset:  # Gemma's 1 + w
                value = value.float() + self.config.norm_offset
            self._copy(owner.get_parameter(target), value, name)
            return
        expected = tuple(owner.get_parameter(target).shape)
        if tuple(value.shape) != expected:
            raise ConfigError(f"weight {name} has shape {tuple(value.shape)}, expected {expected}")
        if isinstance(value, Blocks):
            weight = gguf_weight(value, target, self.dtype) if self.pack else value
        elif self.quantization == "int8":
            weight = Int8Weight.quantize(value)
        else:  # gguf: a float tensor in the file stays float
            weight = value.to(self.dtype)
        replace_weight(owner, target, weight)

    def pack_weights(self) -> None:
        """Pack the GGUF blocks a `pack=False` model holds (a tied lm_head as the embedding)."""
        packed: dict[int, Tensor | QuantWeight] = {}
        for owner in self._weight_owners():
            for name in MATMUL_WEIGHTS:
                w = owner.__dict__.get(name)
                if isinstance(w, Blocks):
                    if id(w) not in packed:
                        packed[id(w)] = gguf_weight(w, name, self.dtype)
                    replace_weight(owner, name, packed[id(w)])
        for decoder in self.layers:
            cast(DecoderLayer, decoder).refresh_weights()

    def prepack_weights(self) -> None:
        """Plain bfloat16 matmul weights to oneDNN's blocked layout (prepacked.py). A tied lm_head
        gets a prepacked copy of its own: the embedding stays plain for lookups."""
        for owner in self._weight_owners():
            for name in MATMUL_WEIGHTS:
                w = getattr(owner, name, None)
                if name != "embed_tokens" and isinstance(w, Tensor):
                    packed = prepack(w.detach())
                    if isinstance(packed, PrepackedWeight):
                        replace_weight(owner, name, packed)
        for decoder in self.layers:
            cast(DecoderLayer, decoder).refresh_weights()

    @staticmethod
    def _copy(param: nn.Parameter, tensor: Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(tensor.shape):
            raise ConfigError(
                f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)


def replace_weight(owner: nn.Module, name: str, weight: Weight | Blocks) -> None:
    """Swap a weight for another object: a tensor as a frozen parameter, anything else as a plain
    attribute (nn.Module refuses a non-Parameter in a parameter's slot)."""
    owner._parameters.pop(name, None)
    owner.__dict__.pop(name, None)
    if isinstance(weight, Tensor):
        if not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        owner.register_parameter(name, weight)
    else:
        owner.__dict__[name] = weight


def _join(parts: list[Tensor | Blocks]) -> Tensor | Blocks:
    """Concatenate the parts of a fused weight (q/k/v, gate/up) along the output rows. Blocks of
    different kinds (Q4_K_M files keep some v in Q6_K) meet dequantized."""
    if len(parts) == 1:
        return parts[0]
    blocks = [p for p in parts if isinstance(p, Blocks)]
    if len(blocks) == len(parts) and Blocks.compatible(blocks):
        return Blocks.cat(blocks)
    return torch.cat([p.dequantize() if isinstance(p, Blocks) else p for p in parts])

"""Llama-family models from GGUF files (llama.cpp's format).

Tensors are dequantized to float32 with `gguf.quants` (vectorised numpy,
a whole tensor at a time), or kept as their quantized blocks for
`--quantization gguf` (quant_linear.Blocks), and renamed to Hugging Face names. llama.cpp's
converter interleaves the two RoPE halves of every q/k head of a Llama
(rows h*D + 2i + j  <-  HF rows h*D + j*D/2 + i); we undo that so the
weights match the HF layout the forward expects. Qwen2 and Qwen3 files keep HF's layout.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from pagedkv.config import ConfigError
from pagedkv.model.config import (
    EXPERT_NAMES,
    GEMMA_LOCAL_ROPE_THETA,
    GEMMA_WINDOW_PATTERN,
    GGUF_EXPERT_TENSOR,
    MODEL_TYPES,
    Checkpoint,
    LlamaConfig,
    all_but_every_nth,
)
from pagedkv.model.quant_linear import KEPT_TYPES, Blocks, blocks_from_gguf
from pagedkv.model.tokenizer import Tokenizer

# general.architecture values whose forward is ours (llama.cpp files Mistral-style models and
# SmolLM under "llama" too); each is also a config.json model_type (MODEL_TYPES: what it adds)
ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "smollm3",
    "granite",
    "granitemoe",
    "olmoe",
    "qwen2moe",
    "qwen3moe",
)
# config.json's model_type where it differs (a Mixtral is a "llama" with experts)
_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# tensors an architecture names its own way: Phi-3 keeps q/k/v and gate/up fused (its ffn_up is
# HF's gate_up_proj, gate first); Gemma 2 and 3 have a norm after attention and one after the MLP
_SANDWICH_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _SANDWICH_NORMS,
    "gemma3": _SANDWICH_NORMS,
}
# llama.cpp's Gemma 2 and 3 (as gemma_pytorch): the 27B models, known by their layer count, scale
# q . k by (hidden / heads)^-0.5, all others by head_dim^-0.5
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's converter interleaves the RoPE halves of q and k only for these ("NORM" RoPE);
# Qwen's GGUFs keep HF's layout ("NEOX")
INTERLEAVED_ROPE = ("llama", "smollm3", "granite", "granitemoe")
# llama.cpp's SmolLM3: every 4th layer without RoPE, a rule of its code (no key in the file)
_NO_ROPE_STEP = {"smollm3": 4}
_GRANITE_KEYS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# a layer's experts: the router, each expert's projections stacked into one [experts, out, in]
# tensor, and Qwen2-MoE's shared expert and its gate; HF's names in the checkpoint's naming
# (config.EXPERT_NAMES), "{e}" where an expert's number goes
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _expert_layer_names(config: LlamaConfig) -> dict[str, str]:
    moe, router, projections = EXPERT_NAMES[config.expert_names]
    names = {"ffn_gate_inp": f"{moe}.{router}", "ffn_gate_inp_shexp": f"{moe}.shared_expert_gate"}
    for tensor, projection in zip(_EXPERT_TENSORS, projections):
        names[tensor] = f"{moe}.experts.{{e}}.{projection}"
    for kind, projection in zip(("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj")):
        names[f"ffn_{kind}_shexp"] = f"{moe}.shared_expert.{projection}"
    return names


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _Reader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of the file map.

    The reader slices its buffer once per vocabulary string; slicing a
    np.memmap costs several times more than slicing an ndarray, which made
    opening a 49k-token GGUF take 3 s instead of 1 s.
    """

    @property  # type: ignore[override]  # the base declares a memmap; an ndarray is the point here
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = np.asarray(value)  # same memory, base ndarray class


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The reader, or a ConfigError saying in one line why the file is not a usable GGUF."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{path}: not a GGUF file (bad magic)")
    try:
        return _Reader(path)
    except (
        Exception
    ) as e:  # ValueError/IndexError/struct errors from a damaged header or short data
        raise ConfigError(
            f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})"
        ) from None


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields as plain Python values."""
    return {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
    }


# llama.cpp's enum llama_pooling_type: none, mean, cls, last, rank
_POOLING_TYPES = (None, "MEAN", "CLS", "LAST")


def _pooling(value: Any) -> str | None:
    """The pooling an embedding model's GGUF declares; a reranker's (rank) is refused."""
    if value not in range(len(_POOLING_TYPES)):
        raise ConfigError(
            f"GGUF pooling_type {value!r}: pagedkv pools mean (1), cls (2) or last (3); "
            "rerankers (4) are not supported"
        )
    return _POOLING_TYPES[value]


def config_from_metadata(meta: dict[str, Any], reader: gguf.GGUFReader) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {arch!r}: pagedkv runs Llama-family GGUF models "
            f"(general.architecture {', '.join(ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError("GGUF file has no token_embd.weight tensor")
    rope_scaling = None
    if "rope_factors_long.weight" in tensors:  # LongRoPE (Phi-3.5, Phi-4-mini), as llama.cpp's
        rope_scaling = {  # converter writes it: the factor sets as tensors
            "rope_type": "longrope",
            **{
                f"{kind}_factor": dequantize(tensors[f"rope_factors_{kind}.weight"]).tolist()
                for kind in ("long", "short")
            },
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
        if f"{arch}.rope.scaling.attn_factor" in meta:
            rope_scaling["attention_factor"] = float(meta[f"{arch}.rope.scaling.attn_factor"])
    elif "rope_freqs.weight" in tensors:
        rope_scaling = {
            "rope_type": "freq_factors",
            "factors": dequantize(tensors["rope_freqs.weight"]).tolist(),
        }
    elif meta.get(f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif meta.get(f"{arch}.rope.scaling.type") == "yarn":
        rope_scaling = {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    elif meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ConfigError(f"unsupported GGUF rope scaling {meta[f'{arch}.rope.scaling.type']!r}")
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0) or None  # Phi-3's, Gemma's
    layers = get("block_count")
    arch_args: dict[str, Any] = {}  # what this architecture adds
    if arch.startswith("gemma"):  # as llama.cpp reads a Gemma file
        arch_args["norm_offset"] = 0.0  # its converter stored 1 + w
    if arch in _GEMMA_27B_LAYERS:
        pattern = GEMMA_WINDOW_PATTERN[_MODEL_TYPE.get(arch, arch)]
        pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern") or pattern)
        arch_args["window_layers"] = all_but_every_nth(layers, pattern)
        if layers == _GEMMA_27B_LAYERS[arch]:
            arch_args["query_pre_attn_scalar"] = hidden // heads
    if arch == "gemma3":
        arch_args["local_rope_theta"] = GEMMA_LOCAL_ROPE_THETA
    # Granite's multipliers, under llama.cpp's names (each written where set)
    if arch in ("granite", "granitemoe"):
        for key, name in _GRANITE_KEYS.items():
            if f"{arch}.{key}" in meta:
                arch_args[name] = float(meta[f"{arch}.{key}"])
    if arch in _NO_ROPE_STEP:
        arch_args["rope_layers"] = all_but_every_nth(layers, _NO_ROPE_STEP[arch])
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if experts:  # (llama.cpp renormalises the chosen experts' weights but Qwen2-MoE's, OLMoE's)
        arch_args.update(
            num_experts=experts,
            experts_per_token=int(get("expert_used_count")),
            moe_intermediate_size=int(
                get("expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length"))
            ),
            norm_topk_prob=bool(
                meta.get(f"{arch}.expert_weights_norm", arch not in ("qwen2moe", "olmoe"))
            ),
            shared_expert_size=int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            moe_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)),
            # (llama.cpp's Mixtral is a "llama" with experts; every file names each expert's
            # gate, up and down, as Qwen's checkpoints do)
            expert_names="mixtral" if arch == "llama" else "qwen",
            float_routing_weights=arch == "llama",
        )
    if f"{arch}.attention.clamp_kqv" in meta:  # (OLMoE's clip_qkv)
        arch_args["clip_qkv"] = float(meta[f"{arch}.attention.clamp_kqv"])
    if arch == "gemma2":
        arch_args["attn_softcap"] = float(get("attn_logit_softcapping", 50.0))
        arch_args["final_softcap"] = float(get("final_logit_softcapping", 30.0))
    return LlamaConfig(
        vocab_size=int(
            tensors["token_embd.weight"].shape[1]
        ),  # GGUF shapes list the fastest dim first
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", 0 if experts else None),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rotary_dim=get("rope.dimension_count", head_dim),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        pooling=_pooling(meta.get(f"{arch}.pooling_type", 0)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        sliding_window=window,
        **{**MODEL_TYPES[_MODEL_TYPE.get(arch, arch)], **arch_args},
    )


def dequantize(t: gguf.ReaderTensor, data: np.ndarray | None = None) -> np.ndarray:
    """float32 array in numpy (row-major, HF) shape: GGUF lists dims fastest-first. `data`: a
    3-d tensor's part for one expert (the shape its last two dims)."""
    try:
        values = gguf.quants.dequantize(t.data if data is None else data, t.tensor_type)
    except NotImplementedError:
        raise ConfigError(
            f"tensor {t.name}: GGUF type {t.tensor_type.name} is not supported"
        ) from None
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if data is not None:
        shape = shape[1:]
    if (
        not values.flags.writeable
    ):  # a view of the read-only file map (F32): torch wants its own copy
        values = values.copy()
    return values.reshape(shape)


def unpermute_rope(w: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's interleaving of the RoPE halves in q/k weight rows."""
    out_dim = w.shape[0]
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def iter_weights(
    reader: gguf.GGUFReader,
    config: LlamaConfig,
    keep_blocks: bool = False,
    arch: str = "llama",
) -> Iterator[tuple[str, Tensor | Blocks]]:
    """(HF name, float32 tensor) one at a time, so a big model never sits dequantized all at once.

    keep_blocks (--quantization gguf): tensors of the types quant_linear runs come as Blocks
    (the file's own codes and scales) instead. arch: the file's general.architecture.
    """
    interleaved = arch in INTERLEAVED_ROPE  # q/k rows in llama.cpp's RoPE order
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if config.num_experts:
        names.update(_expert_layer_names(config))
    for t in reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue  # folded into config.rope_scaling
        m = _LAYER_TENSOR.fullmatch(t.name)
        one = GGUF_EXPERT_TENSOR.fullmatch(t.name) if config.num_experts else None
        if one:  # (an old Mixtral file's: one expert's matrix)
            layer, kind, e = one.groups()
            name = f"model.layers.{layer}.{names[f'ffn_{kind}_exps']}.weight".format(e=e)
        elif m and m.group(2) in names:
            name = f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
        elif t.name in _NAMES:
            name = _NAMES[t.name]
        else:
            raise ConfigError(f"unexpected tensor {t.name!r} in a Llama GGUF file")
        if m and m.group(2) in _EXPERT_TENSORS:  # one matrix an expert, read one at a time
            if len(t.shape) != 3:
                raise ConfigError(f"tensor {t.name}: expected one matrix an expert, not {t.shape}")
            for e in range(int(t.shape[2])):
                yield name.format(e=e), _matrix(t, keep_blocks, t.data[e])
            continue
        w = _matrix(t, keep_blocks)
        if m and m.group(2) == "ffn_gate_inp_shexp":  # (a vector in llama.cpp's files)
            w = (w.dequantize() if isinstance(w, Blocks) else w).reshape(1, -1)
        if interleaved and m and m.group(2) in heads and m.group(3) == "weight":
            # (a bias of a Llama is refused when the model loads)
            w = _rows(w, functools.partial(unpermute_rope, num_heads=heads[m.group(2)]))
        yield name, w


def _matrix(
    t: gguf.ReaderTensor, keep_blocks: bool, expert: np.ndarray | None = None
) -> Tensor | Blocks:
    """A tensor's values (`expert`: one expert's part of a 3-d one), as the file's blocks where
    they are kept, else in float32."""
    if keep_blocks and t.tensor_type in KEPT_TYPES and (len(t.shape) == 2 or expert is not None):
        rows, cols = (int(n) for n in reversed(t.shape.tolist()[:2]))
        return blocks_from_gguf(t.data if expert is None else expert, t.tensor_type, (rows, cols))
    return torch.from_numpy(dequantize(t, expert))


def _rows(w: Tensor | Blocks, fn: Callable[[Tensor], Tensor]) -> Tensor | Blocks:
    return w.map_rows(fn) if isinstance(w, Blocks) else fn(w)


def load_gguf(path: Path, keep_blocks: bool = False) -> Checkpoint:
    reader = open_gguf(path)
    meta = read_metadata(reader)
    config = config_from_metadata(meta, reader)
    arch = meta["general.architecture"]
    return Checkpoint(
        config=config,
        tokenizer=Tokenizer.from_gguf_metadata(meta),
        weights=iter_weights(reader, config, keep_blocks, arch),
        files=[path],
        max_model_len=config.max_position_embeddings,
    )

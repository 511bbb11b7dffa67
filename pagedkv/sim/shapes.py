"""Model shapes for `pagedkv plan`: what the KV cache and the weights cost.

A shape comes from a known name, a Hugging Face folder's config.json, or a
GGUF's metadata. Only the numbers the planner needs are read, so any
decoder-only model with standard multi-head / grouped-query attention works.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.config import ConfigError, default_model_path
from pagedkv.model.config import (
    GEMMA,
    GGUF_EXPERT_TENSOR,
    MODEL_TYPES,
    experts_of,
    text_model_dict,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    source: str  # "known shape", "config.json" or "gguf"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    weight_bytes: int
    max_context: int | None = None


def llama_param_count(
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tied: bool,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    sandwich_norms: bool = False,
    qk_norm_whole: bool = False,
) -> int:
    """Parameters of a Llama-family decoder: embeddings, attention, gated MLP and RMSNorms, with
    Qwen2's q/k/v biases, Qwen3's (and Gemma's) q/k norms (OLMoE's over all heads at once) and
    Gemma's two norms more a layer where the model has them."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    norms = (heads + kv_heads) * head_dim if qk_norm_whole else 2 * head_dim
    attention += qkv_bias * head_dim * (heads + 2 * kv_heads) + qk_norm * norms
    per_layer = attention + 3 * hidden * intermediate + (4 if sandwich_norms else 2) * hidden
    return vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden


def _expert_params(cfg: dict, hidden: int) -> int:
    """What a mixture of experts adds to llama_param_count's MLPs: on each layer with experts,
    the router, every expert and a shared expert with its gate, less the MLP counted there."""
    moe = experts_of(cfg)
    if not moe.get("num_experts"):
        return 0
    layers = moe.get("moe_layers") or (True,) * cfg["num_hidden_layers"]
    experts = moe["num_experts"] * (hidden + 3 * hidden * moe["moe_intermediate_size"])
    shared = 3 * hidden * moe.get("shared_expert_size", 0) + hidden * bool(
        moe.get("shared_expert_size")
    )
    mlp = 3 * hidden * cfg.get("intermediate_size", 4 * hidden)
    return sum(layers) * (experts + shared - mlp)


def _known(
    name: str,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tied: bool,
    context: int,
    experts: dict | None = None,
    *,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    sandwich_norms: bool = False,
) -> ModelShape:
    """experts: a mixture's config.json keys (model_type, num_experts ...), its MLPs replaced."""
    params = llama_param_count(
        vocab,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim,
        tied,
        qkv_bias,
        qk_norm,
        sandwich_norms,
    )
    if experts:
        cfg = {**experts, "num_hidden_layers": layers, "intermediate_size": intermediate}
        params += _expert_params(cfg, hidden)
    return ModelShape(
        name, "known shape", layers, kv_heads, head_dim, params, 2 * params, context
    )  # bf16 weights


_GEMMA: dict[str, Any] = {"qk_norm": True, "sandwich_norms": True}
_MIXTRAL = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
_QWEN3_30B_A3B = {"model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 768}
KNOWN_SHAPES = {
    s.name: s
    for s in (
        _known("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128, False, 8192),
        _known("llama3-70b", 128256, 8192, 28672, 80, 64, 8, 128, False, 8192),
        _known("mistral-7b", 32000, 4096, 14336, 32, 32, 8, 128, False, 32768),
        _known("smollm2-135m", 49152, 576, 1536, 30, 9, 3, 64, True, 8192),
        _known("smollm3-3b", 128256, 2048, 11008, 36, 16, 4, 128, True, 65536),
        _known("phi-3.5-mini", 32064, 3072, 8192, 32, 32, 32, 96, False, 131072),
        _known("phi-4-mini", 200064, 3072, 8192, 32, 24, 8, 128, True, 131072),
        _known("qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, 64, True, 32768, qkv_bias=True),
        _known("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, False, 32768, qkv_bias=True),
        _known("qwen3-0.6b", 151936, 1024, 3072, 28, 16, 8, 128, True, 40960, qk_norm=True),
        _known("qwen3-8b", 151936, 4096, 12288, 36, 32, 8, 128, False, 40960, qk_norm=True),
        _known("gemma-2b", 256000, 2048, 16384, 18, 8, 1, 256, True, 8192),
        _known("gemma2-2b", 256000, 2304, 9216, 26, 8, 4, 256, True, 8192, sandwich_norms=True),
        _known("gemma3-270m", 262144, 640, 2048, 18, 4, 1, 256, True, 32768, **_GEMMA),
        _known("gemma3-1b", 262144, 1152, 6912, 26, 4, 1, 256, True, 32768, **_GEMMA),
        _known("mixtral-8x7b", 32000, 4096, 14336, 32, 32, 8, 128, False, 32768, _MIXTRAL),
        _known(
            "qwen3-30b-a3b",
            151936,
            2048,
            6144,
            48,
            32,
            4,
            128,
            False,
            40960,
            _QWEN3_30B_A3B,
            qk_norm=True,
        ),
    )
}


def shape_by_name(name: str) -> ModelShape:
    try:
        return KNOWN_SHAPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown shape {name!r} (known: {', '.join(KNOWN_SHAPES)})") from None


def _positive_int(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def shape_from_config(folder: Path) -> ModelShape:
    """A Hugging Face folder: config.json for the shape, *.safetensors sizes for the weights."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    raw, cfg = cfg, text_model_dict(cfg)  # (Gemma 3's image-and-text models: their text model)
    cfg = {**cfg, **cfg.get("text_config", {})}  # other multimodal wrappers keep the decoder inside
    try:
        layers = _positive_int(cfg["num_hidden_layers"], "num_hidden_layers", str(path))
        heads = _positive_int(cfg["num_attention_heads"], "num_attention_heads", str(path))
        hidden = _positive_int(cfg["hidden_size"], "hidden_size", str(path))
    except KeyError as e:
        raise ConfigError(f"{path} lacks {e.args[0]!r}") from None
    kv_heads = _positive_int(
        cfg.get("num_key_value_heads") or heads, "num_key_value_heads", str(path)
    )
    head_dim = _positive_int(cfg.get("head_dim") or hidden // heads, "head_dim", str(path))
    params = llama_param_count(
        cfg.get("vocab_size", 0),
        hidden,
        cfg.get("intermediate_size", 4 * hidden),
        layers,
        heads,
        kv_heads,
        head_dim,
        bool(cfg.get("tie_word_embeddings", cfg.get("model_type") in GEMMA)),
        **{
            flag: value
            for flag, value in MODEL_TYPES.get(cfg.get("model_type", ""), {}).items()
            if flag in ("qkv_bias", "qk_norm", "sandwich_norms", "qk_norm_whole")
        },
    )
    params += _expert_params(cfg, hidden)
    files = sorted(folder.glob("*.safetensors"))
    weights = (  # (a multimodal folder's files hold other towers, which are not loaded)
        sum(f.stat().st_size for f in files)
        if files and "text_config" not in raw
        else params * DTYPE_BYTES.get(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16", 2)
    )
    return ModelShape(
        folder.name,
        "config.json",
        layers,
        kv_heads,
        head_dim,
        params,
        weights,
        cfg.get("max_position_embeddings"),
    )


def gguf_resident_bytes(reader, quantization: str) -> int:
    """Bytes the weights take once loaded under --quantization (bfloat16 for dequantized ones;
    packed ones with their dense copy unless PAGEDKV_DENSE_WEIGHTS=0; a tied lm_head over a plain
    embedding with its prepacked copy, model/prepacked.py)."""
    from pagedkv.model.dense_weights import keeps_copies
    from pagedkv.model.prepacked import supported
    from pagedkv.model.quant_linear import resident_bytes

    total, dense = 0, keeps_copies()
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        dims = [int(n) for n in t.shape.tolist()]
        shape = (dims[1], dims[0]) if len(dims) >= 2 else (1, int(t.n_elements))
        vocab = t.name in ("token_embd.weight", "output.weight")
        # (a mixture's [experts, out, in] tensor: one matrix a routed expert, with no dense copy)
        matrices = dims[2] if len(dims) == 3 else 1
        copy = dense and matrices == 1 and not GGUF_EXPERT_TENSOR.fullmatch(t.name)
        held = matrices * resident_bytes(t.tensor_type, shape, quantization, 2, vocab, copy)
        if ".ffn_gate_inp" in t.name:  # a router (and a shared expert's gate): never quantized
            held = 2 * int(t.n_elements)
        plain = held == shape[0] * shape[1] * 2
        if t.name == "token_embd.weight" and "output.weight" not in names and plain and supported():
            held *= 2
        total += held
    return total


def shape_from_gguf(path: Path, quantization: str | None = None) -> ModelShape:
    """A GGUF file: `<arch>.block_count`, `<arch>.attention.head_count_kv` ...

    Weights = what they take once loaded under `quantization` (None: the engine's default for a
    GGUF on CPU, gguf)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise ConfigError(f"cannot read GGUF {path}: invalid or truncated file ({e})") from None

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise ConfigError(f"GGUF {path.name} lacks metadata {key!r}")
            return default
        return field.contents()

    arch = meta("general.architecture")
    layers = meta(f"{arch}.block_count")
    heads = meta(f"{arch}.attention.head_count")
    hidden = meta(f"{arch}.embedding_length")
    kv_heads = meta(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta(f"{arch}.attention.key_length", hidden // heads)
    return ModelShape(
        path.stem,
        "gguf",
        int(layers),
        int(kv_heads),
        int(head_dim),
        sum(int(t.n_elements) for t in reader.tensors),
        gguf_resident_bytes(reader, quantization or "gguf"),
        int(meta(f"{arch}.context_length", 0)) or None,
    )


def quantized(s: ModelShape, quantization: str | None) -> ModelShape:
    """A float checkpoint's shape under --quantization: int8 holds one byte per weight, plus two
    for its bfloat16 copy unless PAGEDKV_DENSE_WEIGHTS=0 (model/dense_weights.py)."""
    if quantization == "gguf":
        raise ConfigError("--quantization gguf needs a .gguf model (use int8 for other models)")
    if quantization != "int8":
        return s
    from pagedkv.model.dense_weights import keeps_copies

    return dataclasses.replace(s, weight_bytes=s.num_params * (3 if keeps_copies() else 1))


def resolve_shape(
    model: str | None = None, shape: str | None = None, quantization: str | None = None
) -> ModelShape:
    """--shape NAME, --model PATH (folder, config.json or .gguf), or the default model."""
    if shape is not None:
        return quantized(shape_by_name(shape), quantization)
    path = Path(model) if model is not None else default_model_path()
    if path.is_dir():
        return quantized(shape_from_config(path), quantization)
    if path.name == "config.json" and path.is_file():
        return quantized(shape_from_config(path.parent), quantization)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return shape_from_gguf(path, quantization)
    if not path.exists():
        raise ConfigError(f"model not found: {path}")
    raise ConfigError(
        f"--model must be a Hugging Face folder with config.json or a .gguf file, got {path}"
    )

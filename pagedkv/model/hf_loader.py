"""Llama-family models from Hugging Face folders: config.json, *.safetensors
(one file or shards listed by model.safetensors.index.json), tokenizer.json. Gemma 3's
image-and-text checkpoints are read as their text model."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from safetensors import safe_open
from torch import Tensor

from pagedkv.config import ConfigError
from pagedkv.model.config import MULTIMODAL_WRAPPERS, Checkpoint, LlamaConfig
from pagedkv.model.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({e})") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the shards the index names, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{index}: unreadable index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{folder}: shard(s) missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors weights (other formats are not supported)")
    return files


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError for truncated or corrupt headers
        raise ConfigError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def iter_weights(
    files: list[Path], rename: Callable[[str], str | None] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every tensor in the files; `rename` gives the name a tensor goes by, or
    None for one left unread."""
    for path in files:
        f = _open(path)
        for stored in f.keys():
            name = stored if rename is None else rename(stored)
            if name is None:
                continue
            try:
                tensor = f.get_tensor(stored)
            except Exception as e:  # data past the end of a truncated file
                raise ConfigError(f"{path}: cannot read tensor {stored} ({e})") from None
            yield name, tensor


# A multimodal checkpoint's text model under the names of the text model's own checkpoint (older
# and newer transformers' layouts); the vision tower and its projector are left unread.
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
    "lm_head.": "lm_head.",
}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def backbone_name(name: str) -> str:
    """A base model's tensor (transformers' Qwen3Model, ...: embed_tokens, layers, norm) under
    its causal LM's name."""
    return "model." + name


def text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under its text model's name; None for the vision part."""
    if name.startswith(_VISION_PREFIXES):
        return None
    prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
    if prefix is None:
        raise ConfigError(f"unexpected weight {name!r} in a multimodal checkpoint")
    return _TEXT_PREFIXES[prefix] + name.removeprefix(prefix)


def load_hf(folder: Path) -> Checkpoint:
    raw = _read_config(folder)
    config = LlamaConfig.from_hf_dict(raw)
    files = safetensors_files(folder)
    # every tensor's name; opening each file fails on a damaged one now, before building anything
    names = {name for path in files for name in _open(path).keys()}
    multimodal = raw.get("model_type") in MULTIMODAL_WRAPPERS
    rename = text_model_name if multimodal else None
    if not multimodal and "embed_tokens.weight" in names:  # a base model's flat names
        rename = backbone_name
    if not multimodal and "lm_head.weight" not in names and not config.tie_word_embeddings:
        # no LM head: embeddings only (the embedding matrix stands in for the head it never uses)
        config = dataclasses.replace(config, tie_word_embeddings=True, generates=False)
    tokenizer = Tokenizer.from_hf_folder(folder, config.eos_token_id)
    if config.encoder and config.num_labels:  # (a BERT cross-encoder's pairs: model/encoder.py)
        config = dataclasses.replace(config, sep_token_id=tokenizer.pair_separator())
    max_model_len = config.max_position_embeddings
    sentence = _sentence_config(folder)
    if sentence.get("do_lower_case"):
        tokenizer.lowercase()
    if isinstance(sentence.get("max_seq_length"), int):  # (the length it was trained to embed)
        max_model_len = min(max_model_len, sentence["max_seq_length"])
    return Checkpoint(
        config=config,
        tokenizer=tokenizer,
        weights=iter_weights(files, rename),
        files=files,
        max_model_len=max_model_len,
    )


def _sentence_config(folder: Path) -> dict:
    """sentence-transformers' sentence_bert_config.json, as vLLM reads it: max_seq_length is
    the context served, do_lower_case lowercases every text first."""
    path = folder / "sentence_bert_config.json"
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({e})") from None
    return found if isinstance(found, dict) else {}

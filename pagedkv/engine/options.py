"""Engine options: --seed and --chat-template act after the model loads; --generation-config and
--override-generation-config give the sampling defaults, read before it.

`apply_engine_options` runs once in LLMEngine.__init__. The seed goes to the
process's generators as vLLM does, and each request without a seed of its own
draws its random stream from them, so a fresh engine given the same requests
in the same order samples the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch

from pagedkv.config import ConfigError, EngineConfig
from pagedkv.engine.request import SamplingParams
from pagedkv.model.tokenizer import compile_template

# generation_config.json key -> SamplingParams field
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(config: EngineConfig) -> dict:
    """Sampling defaults: generation_config.json's, then --override-generation-config's.

    'auto' reads the model's folder; a folder reads that one; 'vllm' none (as vLLM, the override
    still applies)."""
    data = _generation_config(config)
    overrides = config.override_generation_config or {}
    assert isinstance(overrides, dict)  # EngineConfig parsed the flag's JSON
    unknown = sorted(set(overrides) - set(_GENERATION_KEYS))
    if unknown:
        raise ConfigError(
            f"--override-generation-config: {unknown[0]!r} is not one of "
            f"{', '.join(_GENERATION_KEYS)}"
        )
    data = {**data, **overrides}
    defaults = {
        field: data[key] for key, field in _GENERATION_KEYS.items() if data.get(key) is not None
    }
    try:
        SamplingParams(**defaults)  # a bad value fails at start-up, naming the field
    except ConfigError as e:
        raise ConfigError(f"generation defaults: {e}") from None
    return defaults


def _generation_config(config: EngineConfig) -> dict:
    """The model's (or a folder's) generation_config.json, {} where there is none."""
    if config.generation_config == "vllm":
        return {}
    folder = config.model if config.generation_config == "auto" else config.generation_config
    path = Path(folder) / "generation_config.json" if folder and Path(folder).is_dir() else None
    if path is None or not path.is_file():
        return {}  # a GGUF carries no generation config
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def with_defaults(params: SamplingParams, defaults: dict, unset: set[str]) -> SamplingParams:
    """`params` with the model's defaults for the fields in `unset` (those the user left out)."""
    chosen = {k: v for k, v in defaults.items() if k in unset}
    return dataclasses.replace(params, **chosen) if chosen else params


def apply_engine_options(engine, config: EngineConfig) -> None:
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    if config.chat_template is not None:
        # compiled now: a broken one given here is the server's mistake, not each request's 400
        # (the model's own template compiles at first use, so that plain prompts still run)
        try:
            compile_template(config.chat_template)
        except ConfigError as e:
            raise ConfigError(f"--chat-template: {e}") from None
        engine.tokenizer.chat_template = config.chat_template

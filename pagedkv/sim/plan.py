"""Capacity planning: KV bytes per token, and how many tokens and requests fit.

K and V each take num_layers x num_kv_heads x head_dim elements per token.
The pool is whole blocks, so capacity is counted in blocks first. fp8 and
int8 keep one float32 scale per (layer, K or V, token, KV head) beside the
blocks (kvstore/quant.py), counted in each block's bytes as the engine's pool does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.config import KV_CACHE_DTYPES, ConfigError
from pagedkv.sim.shapes import ModelShape

# bytes per K or V element; "auto" is the model's bf16
KV_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "int8": 1}
SCALE_BYTES = 4  # per (layer, K or V, token, KV head) of a quantized dtype
QUANTIZED = ("fp8", "int8")


def kv_bytes_per_block(shape: ModelShape, kv_dtype: str, block_size: int) -> int:
    """Bytes one block of `block_size` tokens takes across all layers, K and V, scales included."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ConfigError(
            f"--kv-cache-dtype must be one of {', '.join(KV_DTYPE_BYTES)}, got {kv_dtype!r}"
        )
    heads = shape.num_layers * shape.num_kv_heads * 2  # K and V
    row = shape.head_dim * KV_DTYPE_BYTES[kv_dtype] + (SCALE_BYTES if kv_dtype in QUANTIZED else 0)
    return heads * row * block_size


@dataclass(frozen=True, slots=True)
class DtypeCapacity:
    kv_cache_dtype: str
    bytes_per_token: float
    bytes_per_block: int
    blocks: int
    tokens: int
    requests_at_context: int


@dataclass(frozen=True, slots=True)
class Plan:
    model: str
    source: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int | None
    num_params: int
    weight_bytes: int
    memory: int
    memory_utilization: float
    kv_memory: int
    block_size: int
    context: int
    dtypes: list[DtypeCapacity]

    def to_dict(self) -> dict:
        return asdict(self)


def check_budget(memory: int, memory_utilization: float, context: int, block_size: int) -> None:
    """The planner's numeric inputs, checked before any model file is read."""
    if memory < 1:
        raise ConfigError(f"--memory must be a positive size, got {memory}")
    if not 0.0 < memory_utilization <= 1.0:
        raise ConfigError(f"--memory-utilization must be in (0, 1], got {memory_utilization}")
    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {context}")
    if block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {block_size}")


def plan_capacity(
    shape: ModelShape,
    *,
    memory: int,
    memory_utilization: float = 0.9,
    context: int = 128000,
    block_size: int = 16,
    kv_dtypes: tuple[str, ...] = KV_CACHE_DTYPES,
) -> Plan:
    """Tokens that fit in memory x utilization after the weights.

    Also how many requests of `context` tokens fit."""
    check_budget(memory, memory_utilization, context, block_size)
    kv_memory = max(0, int(memory * memory_utilization) - shape.weight_bytes)
    blocks_per_request = -(-context // block_size)
    rows = []
    for dtype in kv_dtypes:
        per_block = kv_bytes_per_block(shape, dtype, block_size)
        blocks = kv_memory // per_block
        per_token = per_block / block_size
        rows.append(
            DtypeCapacity(
                dtype,
                int(per_token) if per_token.is_integer() else per_token,
                per_block,
                blocks,
                blocks * block_size,
                blocks // blocks_per_request,
            )
        )
    return Plan(
        shape.name,
        shape.source,
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_dim,
        shape.max_context,
        shape.num_params,
        shape.weight_bytes,
        memory,
        memory_utilization,
        kv_memory,
        block_size,
        context,
        rows,
    )

"""The K/V tensors of the block pool: one tensor for all layers.

    data: [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]

`layer(i)` gives the (k_cache, v_cache) views the attention reads, each
[num_blocks, num_kv_heads, block_size, head_dim]. Block ids are the block
pool's ids; this module knows shapes and dtypes, never the model or who owns
a block.

Blocks leave the pool (swap, offload) block-major: `read_blocks` returns
[n, num_layers, 2, num_kv_heads, block_size, head_dim], so each block's
bytes are contiguous and exactly `bytes_per_block` long, the unit a host or
disk tier stores. Swap space is simply another KVStorage on the CPU
(`read_blocks` of one feeds `write_blocks` of the other). Quantized KV
dtypes (fp8/int8) would subclass this and keep per-block scales next to
`data`; nothing here assumes a float dtype beyond its item size.
"""
from __future__ import annotations

import torch
from torch import Tensor

from pagedkv.config import ConfigError

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, also from the names --kv-cache-dtype takes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"KV cache dtype {dtype!r} is not supported (use {', '.join(_DTYPE_NAMES)})")
    return _DTYPE_NAMES[dtype]


def _ids(ids: list[int] | Tensor, device: torch.device) -> Tensor:
    return torch.as_tensor(ids, dtype=torch.int64).to(device)


class KVStorage:
    """Device tensors of the paged KV cache."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype: torch.dtype | str, device: str | torch.device = "cpu") -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.head_dim = head_dim
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        self.data = torch.zeros(num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim,
                                dtype=self.dtype, device=self.device)
        self.kv_caches: list[tuple[Tensor, Tensor]] = [self.layer(i) for i in range(num_layers)]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """(k_cache, v_cache) of layer i, each [num_blocks, num_kv_heads, block_size, head_dim]."""
        return self.data[i, 0], self.data[i, 1]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as `read_blocks` returns it (without the leading n)."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst for every (src, dst), all layers in one go."""
        if not pairs:
            return
        src = _ids([s for s, _ in pairs], self.device)
        dst = _ids([d for _, d in pairs], self.device)
        self.data.index_copy_(2, dst, self.data.index_select(2, src))

    def read_blocks(self, ids: list[int] | Tensor) -> Tensor:
        """The blocks' K/V, block-major: [n, num_layers, 2, num_kv_heads, block_size, head_dim]."""
        picked = self.data.index_select(2, _ids(ids, self.device))
        return picked.permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, ids: list[int] | Tensor, blocks: Tensor) -> None:
        """Inverse of `read_blocks`: store block-major `blocks` (any device) at block ids."""
        src = blocks.to(device=self.device, dtype=self.dtype).permute(1, 2, 0, 3, 4, 5)
        self.data.index_copy_(2, _ids(ids, self.device), src)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                        dtype: torch.dtype | str) -> int:
        """K and V of one block across all layers."""
        return 2 * num_layers * num_kv_heads * block_size * head_dim * as_dtype(dtype).itemsize

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> int:
        return KVStorage.bytes_per_block(num_layers, num_kv_heads, 1, head_dim, dtype)

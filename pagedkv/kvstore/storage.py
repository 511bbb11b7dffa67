"""The K/V tensors of the block pool: one tensor for all layers.

    data:   [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]
    scales: [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size] float32  (fp8 / int8 only)

`layer(i)` gives the (k_cache, v_cache) the attention reads: for float
dtypes two tensors [num_blocks, num_kv_heads, block_size, head_dim]; for the
quantized dtypes (fp8 = float8_e4m3fn, int8) two `QuantizedCache`s, the same
views of `data` with their slices of `scales` (see quant.py). Block ids are
the block pool's ids; this module knows shapes and dtypes, never the model or
who owns a block.

Blocks leave the pool (swap, offload) block-major, as one tensor of `dtype`
shaped [n, *block_shape] whose block is exactly `bytes_per_block` bytes, the
unit a host or disk tier stores:

    float dtypes:  block_shape = (num_layers, 2, num_kv_heads, block_size, head_dim)
    fp8 / int8:    block_shape = (bytes_per_block,), packed bytes: the block's data in
                   (layer, K/V, head, offset, dim) order, then its float32 scales in
                   (layer, K/V, head, offset) order

Swap space is simply another KVStorage on the CPU (`read_blocks` of one feeds
`write_blocks` of the other), so callers never look inside a block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pagedkv import cpu_memory
from pagedkv.config import ConfigError, format_size
from pagedkv.kvstore.quant import FORMATS, SCALE_DTYPE, QuantizedCache

_DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype, also from the names --kv-cache-dtype takes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(
            f"KV cache dtype {dtype!r} is not supported (use {', '.join(_DTYPE_NAMES)})"
        )
    return _DTYPE_NAMES[dtype]


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` (None where it cannot be asked)."""
    if device.type == "cpu":
        import psutil

        return psutil.virtual_memory().available
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def _ids(ids: list[int] | Tensor, device: torch.device) -> Tensor:
    return torch.as_tensor(ids, dtype=torch.int64).to(device)


class KVStorage:
    """Device tensors of the paged KV cache."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype | str,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.head_dim = head_dim
        self.dtype = as_dtype(dtype)
        self.device = torch.device(device)
        self.quant = FORMATS.get(self.dtype)
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        self.data = self._allocate(shape)
        self.scales: Tensor | None = None
        # Block moves are byte copies: float8 has no index_copy_ on CPU, its uint8 view does.
        self._raw = self.data
        if self.quant is not None:
            self.scales = torch.zeros(*shape[:-1], dtype=SCALE_DTYPE, device=self.device)
            self._raw = self.data.view(torch.uint8)
        self.kv_caches: list[tuple] = [self.layer(i) for i in range(num_layers)]

    def _allocate(self, shape: tuple[int, ...]) -> Tensor:
        """The zeroed pool; one that cannot fit is a ConfigError naming the sizes, not an
        allocator's traceback (or, on CPU, an OOM kill while zeroing what overcommit granted)."""
        need = math.prod(shape) * self.dtype.itemsize
        free = free_memory(self.device)
        too_big = f"{format_size(need)} of KV blocks ({self.num_blocks} blocks) on {self.device}"
        hint = "give --kv-cache-memory, --swap-space or --kv-offload-host-memory less"
        if free is not None and need > free:
            raise ConfigError(f"{too_big} exceed its {format_size(free)} of free memory: {hint}")
        try:
            if self.device.type == "cpu":  # read in 4 KiB runs: 2 MiB pages spare TLB misses
                return cpu_memory.zeros(*shape, dtype=self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(f"{too_big} could not be allocated ({e}): {hint}") from None

    def layer(self, i: int) -> tuple[Tensor, Tensor] | tuple[QuantizedCache, QuantizedCache]:
        """(k_cache, v_cache) of layer i, each [num_blocks, num_kv_heads, block_size, head_dim]."""
        if self.quant is None:
            return self.data[i, 0], self.data[i, 1]
        assert self.scales is not None  # set with self.quant
        return (
            QuantizedCache(self.data[i, 0], self.scales[i, 0], self.quant),
            QuantizedCache(self.data[i, 1], self.scales[i, 1], self.quant),
        )

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block as `read_blocks` returns it (without the leading n)."""
        if self.quant is not None:
            return (
                self.bytes_per_block(
                    self.num_layers, self.num_kv_heads, self.block_size, self.head_dim, self.dtype
                ),
            )
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst for every (src, dst), all layers in one go."""
        if not pairs:
            return
        src = _ids([s for s, _ in pairs], self.device)
        dst = _ids([d for _, d in pairs], self.device)
        self._raw.index_copy_(2, dst, self._raw.index_select(2, src))
        if self.scales is not None:
            self.scales.index_copy_(2, dst, self.scales.index_select(2, src))

    def read_blocks(self, ids: list[int] | Tensor) -> Tensor:
        """The blocks block-major: [n, *block_shape] of `dtype`, scales packed in for fp8/int8."""
        ids = _ids(ids, self.device)
        picked = self._raw.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        if self.scales is None:
            return picked
        scales = self.scales.index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous()
        scales = scales.view(torch.uint8)
        n = ids.numel()
        return torch.cat([picked.view(n, -1), scales.view(n, -1)], dim=1).view(self.dtype)

    def write_blocks(self, ids: list[int] | Tensor, blocks: Tensor) -> None:
        """Inverse of `read_blocks`: store block-major `blocks` (any device) at block ids."""
        ids = _ids(ids, self.device)
        if self.scales is None:
            src = blocks.to(device=self.device, dtype=self.dtype).permute(1, 2, 0, 3, 4, 5)
            self.data.index_copy_(2, ids, src)
            return
        if blocks.dtype != self.dtype or tuple(blocks.shape[1:]) != self.block_shape:
            raise ValueError(
                f"expected packed {self.dtype} blocks of shape [n, {self.block_shape[0]}], "
                f"got {blocks.dtype} {list(blocks.shape)}"
            )
        packed = blocks.to(self.device).view(torch.uint8)
        n, split = packed.shape[0], self.data[:, :, 0].numel()  # data bytes of one block
        data = packed[:, :split].reshape(
            n, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim
        )
        self._raw.index_copy_(2, ids, data.permute(1, 2, 0, 3, 4, 5))
        scales = (
            packed[:, split:]
            .contiguous()
            .view(SCALE_DTYPE)
            .view(n, self.num_layers, 2, self.num_kv_heads, self.block_size)
        )
        self.scales.index_copy_(2, ids, scales.permute(1, 2, 0, 3, 4))

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype | str
    ) -> int:
        """K and V of one block across all layers, with their scales for fp8 / int8."""
        return block_size * KVStorage.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str
    ) -> int:
        """Bytes of one token's K and V across all layers, with its scales for fp8 / int8."""
        dtype = as_dtype(dtype)
        scale = SCALE_DTYPE.itemsize if dtype in FORMATS else 0
        return 2 * num_layers * num_kv_heads * (head_dim * dtype.itemsize + scale)

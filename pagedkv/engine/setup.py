"""What an engine is built from: the device, the model (or a tensor-parallel rank's shard of it),
the KV pool's size and tensors, the offload tiers. Rank 0 (LLMEngine) and the worker ranks build
theirs with the same functions, in the same order, so their pools match block for block."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedkv import native
from pagedkv.attention import cascade
from pagedkv.config import ConfigError, EngineConfig, format_size
from pagedkv.engine.runner import ModelRunner
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.plan import OffloadTiers
from pagedkv.kvstore.offload import KVOffload
from pagedkv.kvstore.storage import KVStorage, free_memory
from pagedkv.model import dense_weights, prepacked
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import LoadedModel, load_model
from pagedkv.model.lora import LoRACut

if TYPE_CHECKING:
    from pagedkv.distributed.group import TensorParallelGroup

log = logging.getLogger("pagedkv")

CPU_DEFAULT_KV_CAP = 4 * 2**30  # on CPU, --memory-utilization alone never takes more than this


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    """Pool size: an exact block count, else --kv-cache-memory, else a share of free memory."""
    if config.num_gpu_blocks_override is not None:
        n = config.num_gpu_blocks_override
    elif config.kv_cache_memory is not None:
        n = config.kv_cache_memory // bytes_per_block
    else:
        budget = int((free_memory(device) or 0) * config.memory_utilization)
        if device.type == "cpu" and budget > CPU_DEFAULT_KV_CAP:
            log.info(
                "KV pool capped at %s on CPU; pass --kv-cache-memory for more",
                format_size(CPU_DEFAULT_KV_CAP),
            )
            budget = CPU_DEFAULT_KV_CAP
        n = budget // bytes_per_block
    if n < 1:
        raise ConfigError(
            f"the KV cache memory holds no block of {bytes_per_block} bytes; give it more memory"
        )
    return int(n)


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype | str:
    return dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype


def build_kv_storage(
    config: EngineConfig, mc, num_kv_heads: int, dtype: torch.dtype, device: torch.device
) -> tuple[KVStorage, KVStorage | None, int]:
    """The KV pool, the swap space (unless swap borrows the host tier's slots) and the bytes per
    block: the same on every tensor-parallel rank, sized by the smallest rank."""
    shape = dict(
        num_layers=0 if mc.encoder else mc.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        block_size=config.block_size,
        head_dim=mc.head_dim,
        dtype=kv_cache_dtype(config, dtype),
    )
    bytes_per_block = KVStorage.bytes_per_block(**shape)
    if mc.encoder:  # (blocks of no bytes: they count a step's tokens, for --max-num-seqs prompts)
        whole = -(-mc.max_position_embeddings // config.block_size)
        num_blocks = config.num_gpu_blocks_override or config.max_num_seqs * whole
    else:
        num_blocks = num_kv_blocks(config, bytes_per_block, device)
    if config.tensor_parallel_size > 1:
        from pagedkv.distributed.group import min_over_ranks

        num_blocks = min_over_ranks(num_blocks, poll_s=0.05)  # (SIGTERM: see its docstring)
    storage = KVStorage(num_blocks=num_blocks, device=device, **shape)
    host = None
    if (
        config.preemption_mode == "swap" and not config.kv_offload_host_memory
    ):  # else the host tier's slots
        if config.swap_space_bytes < bytes_per_block:  # asked to swap, given no room to
            raise ConfigError(
                f"--swap-space {format_size(config.swap_space_bytes)} holds no KV block "
                f"({format_size(bytes_per_block)} each) for --preemption-mode swap"
            )
        host = KVStorage(
            num_blocks=config.swap_space_bytes // bytes_per_block,
            device=torch.device("cpu"),
            **shape,
        )
    return storage, host, bytes_per_block


def load_rank_model(
    config: EngineConfig, device: torch.device, rank: int = 0, loaded: LoadedModel | None = None
) -> tuple[LoadedModel, int]:
    """The model this process runs and its KV heads: the whole model, or with -tp N rank's shard
    of it (quantized as -tp 1 would: GGUF blocks are cut before they are packed)."""
    world = config.tensor_parallel_size
    if world == 1:
        loaded = loaded or load_model(
            config.model,
            config.dtype,
            device,
            config.quantization,
            sliding_window=not config.disable_sliding_window,
            max_model_len=config.max_model_len,
        )
        return loaded, loaded.config.num_key_value_heads
    from pagedkv.distributed.group import all_reduce
    from pagedkv.distributed.shard import shard_model

    if loaded is None:
        loaded = load_model(
            config.model,
            config.dtype,
            device,
            config.quantization,
            pack=False,
            sliding_window=not config.disable_sliding_window,
            max_model_len=config.max_model_len,
        )
    if not isinstance(loaded.model, LlamaForCausalLM):
        raise ConfigError("--tensor-parallel-size: pagedkv runs an encoder on one rank")
    return loaded, shard_model(loaded.model, rank, world, all_reduce).num_kv_heads


def block_hash_key(config: EngineConfig, loaded: LoadedModel) -> bytes:
    """What block hashes (and the disk tier's files) are keyed by besides the tokens: the weights
    and the KV dtype."""
    return f"{loaded.fingerprint}:{kv_cache_dtype(config, loaded.model.dtype)}".encode()


def build_offload(
    config: EngineConfig, storage: KVStorage, swap: KVStorage | None, key: bytes, rank: int = 0
) -> tuple[KVOffload | None, KVStorage | None]:
    """The offload tiers behind `storage`, and the host blocks swap uses: the host tier's slots
    when there is one, else `swap`. A tensor-parallel rank's disk files are keyed by the rank and
    the TP size: no other rank, and no engine of another TP size, reads them; the ranks share
    --kv-offload-disk-size."""
    world = config.tensor_parallel_size
    disk_key = key if world == 1 else key + f":tp{rank}of{world}".encode()
    offload = KVOffload.from_config(config, storage, disk_key, ranks=world)
    if offload is not None and offload.host is not None:
        return offload, offload.host.storage
    return offload, swap


def build_worker_runner(config: EngineConfig, rank: int, device: torch.device) -> ModelRunner:
    """A tensor-parallel worker's model shard, KV pool, swap space and offload tiers, built in rank
    0's order."""
    loaded, num_kv_heads = load_rank_model(config, device, rank)
    storage, swap, _ = build_kv_storage(
        config, loaded.config, num_kv_heads, loaded.model.dtype, device
    )
    offload, host = build_offload(config, storage, swap, block_hash_key(config, loaded), rank)
    cut = rank_lora_cut(config, loaded, rank)
    return ModelRunner(loaded.model, storage, host, device, offload=offload, lora_cut=cut)


def rank_lora_cut(config: EngineConfig, loaded: LoadedModel, rank: int) -> LoRACut | None:
    """This tensor-parallel rank's share of every LoRA adapter (None: one rank, all of it)."""
    if config.tensor_parallel_size == 1 or not config.enable_lora:
        return None
    from pagedkv.distributed.shard import lora_cut

    return lora_cut(loaded.config, rank, config.tensor_parallel_size)


def check_environment(device: torch.device) -> None:
    """The PAGEDKV_* settings, checked before anything loads: a mistyped one is a ConfigError
    (one line, exit 2), not a failure of every request (PAGEDKV_CASCADE is read each step) or a
    quiet fall back to the torch paths (PAGEDKV_KERNELS, PAGEDKV_CPU_ISA)."""
    try:
        cascade.mode()
        prepacked.setting()
        dense_weights.fixed_rows()
        if native.kernels_wanted() and device.type == "cpu":
            native.selected_isa()
    except ValueError as e:  # (a ConfigError is one)
        raise ConfigError(str(e)) from None


def load_engine_model(
    config: EngineConfig, device: torch.device, loaded: LoadedModel | None = None
) -> tuple[LoadedModel, int]:
    """Rank 0's weights (its -tp shard, as --quantization asks), tokenizer and model config;
    and the KV heads this rank holds."""
    t0 = time.monotonic()
    loaded, num_kv_heads = load_rank_model(config, device, 0, loaded)
    log.info(
        "loaded %s in %.1fs: weights %s (quantization %s)",
        loaded.name,
        time.monotonic() - t0,
        format_size(loaded.model.weight_bytes()),
        loaded.quantization,
    )
    return loaded, num_kv_heads


@dataclass
class EngineKV:
    """Rank 0's KV side, as build_engine_kv makes it."""

    tp: TensorParallelGroup | None  # the -tp N workers (started first: they build in this order)
    storage: KVStorage  # the pool: this rank's heads
    offload: KVOffload | None
    manager: KVCacheManager
    host: KVStorage | None  # where swap preemption moves blocks (None without swap)


def build_engine_kv(
    config: EngineConfig,
    loaded: LoadedModel,
    num_kv_heads: int,
    device: torch.device,
    max_model_len: int,
) -> EngineKV:
    """The KV pool (this rank's heads), its offload tiers and the block manager."""
    dtype = loaded.model.dtype  # 'auto' was resolved for this model and device
    tp = None
    if config.tensor_parallel_size > 1:
        from pagedkv.distributed.group import TensorParallelGroup

        tp = TensorParallelGroup(config, dtype, device)
    storage, swap, bytes_per_block = build_kv_storage(
        config, loaded.config, num_kv_heads, dtype, device
    )
    num_blocks = storage.num_blocks
    hash_extra = block_hash_key(config, loaded)
    # swap borrows the host tier's slots when there is one (then `swap` is None)
    offload, host = build_offload(config, storage, swap, hash_extra)
    tiers: OffloadTiers | None = offload
    if tp is not None and offload is not None:
        from pagedkv.distributed.tiers import TensorParallelTiers

        tiers = TensorParallelTiers(offload, tp)
    manager = KVCacheManager(
        num_blocks,
        config.block_size,
        num_host_blocks=swap.num_blocks if swap is not None else 0,
        enable_prefix_caching=config.enable_prefix_caching,
        allocation_policy=config.allocation_policy,
        max_model_len=max_model_len,
        hash_extra=hash_extra,
        offload=tiers,
    )
    log.info(
        "KV pool: %d blocks of %d tokens (%s, %d tokens), max_model_len %d",
        num_blocks,
        config.block_size,
        format_size(num_blocks * bytes_per_block),
        num_blocks * config.block_size,
        max_model_len,
    )
    return EngineKV(tp, storage, offload, manager, host)

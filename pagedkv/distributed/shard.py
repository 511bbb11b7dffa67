"""Split a loaded Llama model as vLLM splits it: column-parallel qkv and gate/up, row-parallel o and down.

Rank r keeps num_heads / world query heads and their KV heads (or, with fewer
KV heads than ranks, the one KV head its query heads read: replicated), the same
share of the MLP's intermediate size, and all of the embeddings, norms and
lm_head. The outputs of o_proj and down_proj are partial sums: one all-reduce
after each makes every rank's residual stream equal the unsplit model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pagedkv.config import ConfigError
from pagedkv.model.llama import DecoderLayer, LlamaForCausalLM


@dataclass(frozen=True)
class HeadSplit:
    q_heads: range  # this rank's query heads
    kv_heads: range  # the KV heads they read (one replicated head when KV heads < ranks)

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def split_heads(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadSplit:
    if num_heads % world:
        raise ConfigError(
            f"--tensor-parallel-size {world} does not divide the model's {num_heads} attention heads"
        )
    if num_kv_heads % world and world % num_kv_heads:
        raise ConfigError(
            f"--tensor-parallel-size {world} and the model's {num_kv_heads} KV heads: "
            "one must divide the other"
        )
    per_rank = num_heads // world
    q = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads % world == 0:
        kv_per_rank = num_kv_heads // world
        return HeadSplit(q, range(rank * kv_per_rank, (rank + 1) * kv_per_rank))
    group = num_heads // num_kv_heads  # query heads per KV head
    kv = q.start // group
    return HeadSplit(q, range(kv, kv + 1))


def check_shardable(config, world: int) -> None:
    """Every rank's split exists (heads and MLP divide): checked before any worker starts."""
    split_heads(config.num_attention_heads, config.num_key_value_heads, 0, world)
    if config.intermediate_size % world:
        raise ConfigError(
            f"--tensor-parallel-size {world} does not divide the MLP's "
            f"{config.intermediate_size} features"
        )


def _rows(w: Tensor, heads: range, head_dim: int) -> Tensor:
    return w[heads.start * head_dim : heads.stop * head_dim]


def _shard_layer(
    layer: DecoderLayer,
    split: HeadSplit,
    rank: int,
    world: int,
    all_reduce: Callable[[Tensor], None],
) -> None:
    d = layer.head_dim
    norm1, qkv, o, norm2, gate_up, down = layer.__dict__["_weights"]  # set there by DecoderLayer
    q_size, kv_size = layer.q_size, layer.kv_size
    q_w, k_w, v_w = qkv.data.split([q_size, kv_size, kv_size])
    inter = gate_up.shape[0] // 2
    part = slice(rank * inter // world, (rank + 1) * inter // world)
    gate_w, up_w = gate_up.data.split([inter, inter])
    new = {
        "qkv_proj": torch.cat(
            [
                _rows(q_w, split.q_heads, d),
                _rows(k_w, split.kv_heads, d),
                _rows(v_w, split.kv_heads, d),
            ]
        ),
        "o_proj": o.data[:, split.q_heads.start * d : split.q_heads.stop * d],
        "gate_up_proj": torch.cat([gate_w[part], up_w[part]]),
        "down_proj": down.data[:, part],
    }
    for name, w in new.items():
        setattr(layer, name, nn.Parameter(w.contiguous(), requires_grad=False))
    layer.num_heads, layer.num_kv_heads = split.num_heads, split.num_kv_heads
    layer.q_size, layer.kv_size = split.num_heads * d, split.num_kv_heads * d
    layer.__dict__["_weights"] = (
        norm1,
        layer.qkv_proj,
        layer.o_proj,
        norm2,
        layer.gate_up_proj,
        layer.down_proj,
    )
    layer.__dict__["all_reduce"] = all_reduce


def shard_model(
    model: LlamaForCausalLM, rank: int, world: int, all_reduce: Callable[[Tensor], None]
) -> HeadSplit:
    """Cut every layer of a loaded model down to rank's shard, in place; returns the head split."""
    c = model.config
    check_shardable(c, world)
    split = split_heads(c.num_attention_heads, c.num_key_value_heads, rank, world)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        _shard_layer(layer, split, rank, world, all_reduce)
    return split

"""Split a loaded Llama model as vLLM splits it: column-parallel qkv and gate/up, row-parallel o
and down.

Rank r keeps num_heads / world query heads and their KV heads (or, with fewer
KV heads than ranks, the one KV head its query heads read: replicated), the same
share of the MLP's intermediate size (of each expert's, in a mixture of experts,
whose router every rank keeps whole and runs alike), and all of the embeddings,
norms and lm_head. The outputs of o_proj and down_proj (of the experts' downs,
weighted and summed) are partial sums: one all-reduce after each makes every
rank's residual stream equal the unsplit model's.

Quantized weights are cut in the form that keeps -tp 1's numbers: int8 after
quantizing (a row keeps its whole-row scale), GGUF blocks before packing (the
packed int4 layout cannot be cut), each block's scale and zero going with its
codes. A row-parallel cut must fall between GGUF blocks of the input dimension.

LoRA adapters are cut in the same places (`lora_cut`): each rank adds its share of a delta.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedkv.config import ConfigError
from pagedkv.model.config import LlamaConfig
from pagedkv.model.llama import DecoderLayer, LlamaForCausalLM, replace_weight
from pagedkv.model.loader import finish_weights
from pagedkv.model.lora import LoRACut
from pagedkv.model.moe import Expert
from pagedkv.model.quant_linear import Blocks, Int8Weight

Cuttable = Tensor | Int8Weight | Blocks
_INT4_ROWS = 16  # the packed int4 kernel takes row counts in multiples of this


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
            f"--tensor-parallel-size {world} does not divide the model's {num_heads} "
            "attention heads"
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
    if config.qk_norm_whole:
        raise ConfigError(
            "--tensor-parallel-size over 1 cannot split q and k norms taken over all heads at "
            "once (OLMoE's)"
        )
    layers = range(config.num_hidden_layers)
    sizes = {
        "MLP": config.intermediate_size if not all(map(config.layer_moe, layers)) else 0,
        "experts": config.moe_intermediate_size if config.num_experts else 0,
        "shared expert": config.shared_expert_size,
    }
    for what, size in sizes.items():
        if size % world:
            raise ConfigError(
                f"--tensor-parallel-size {world} does not divide the {what}'s {size} features"
            )


def _cut_refused(name: str, what: str) -> ConfigError:
    return ConfigError(f"tensor parallelism cannot split {name}: {what}")


def take_rows(w: Cuttable, parts: list[range], name: str) -> Cuttable:
    """Output rows (column parallelism): each row keeps its own codes, scales and zeros."""

    def pick(t: Tensor) -> Tensor:
        return torch.cat([t[r.start : r.stop] for r in parts]).contiguous()

    if isinstance(w, Blocks):
        n, rows = w.shape[0], sum(len(r) for r in parts)
        if w.bits == 4 and n % _INT4_ROWS == 0 and rows % _INT4_ROWS:
            raise _cut_refused(
                name,
                f"{rows} of its {n} rows per rank, and the int4 kernel packs rows in multiples "
                f"of {_INT4_ROWS}: use another --tensor-parallel-size or --quantization none",
            )
        return w.map_rows(pick)
    if isinstance(w, Int8Weight):
        return Int8Weight(pick(w.q), pick(w.scale))
    if isinstance(w, Tensor):
        return pick(w)
    raise _cut_refused(name, "its weights are packed already (load it with pack=False)")


def take_cols(w: Cuttable, cols: range, name: str) -> Cuttable:
    """Input columns (row parallelism): int8 rows keep their whole-row scales; a GGUF block of the
    input dimension is never split."""
    a, b = cols.start, cols.stop
    if isinstance(w, Blocks):
        g, k = w.group, w.shape[1]
        if a % g or b % g:
            raise _cut_refused(
                name,
                f"its {k} input features in {len(cols)} per rank are not whole GGUF blocks of {g}: "
                "use another --tensor-parallel-size or --quantization none",
            )
        s = slice(a // g, b // g)
        zero = None if w.zero is None else w.zero[:, s].contiguous()
        return Blocks(w.q[:, a:b].contiguous(), w.scale[:, s].contiguous(), zero, g, w.bits)
    if isinstance(w, Int8Weight):
        return Int8Weight(w.q[:, a:b].contiguous(), w.scale)
    if isinstance(w, Tensor):
        return w[:, a:b].contiguous()
    raise _cut_refused(name, "its weights are packed already (load it with pack=False)")


def _span(heads: range, head_dim: int, offset: int = 0) -> range:
    return range(offset + heads.start * head_dim, offset + heads.stop * head_dim)


@dataclass(frozen=True)
class LayerCuts:
    """What a rank keeps of one layer's projections."""

    rows: dict[str, list[range]]  # column-parallel: the output rows of each fused part it keeps
    cols: dict[str, range]  # row-parallel: the input features it reads


def attention_cuts(head_dim: int, q_size: int, kv_size: int, split: HeadSplit) -> LayerCuts:
    """The attention's share: its heads' rows of q, k and v, their input features of o."""
    q, kv = _span(split.q_heads, head_dim), split.kv_heads
    qkv = [q, _span(kv, head_dim, q_size), _span(kv, head_dim, q_size + kv_size)]
    return LayerCuts({"qkv_proj": qkv}, {"o_proj": q})


def mlp_cuts(inter: int, rank: int, world: int) -> LayerCuts:
    """A gated MLP's (or an expert's) share: gate's and up's rows, down's input features."""
    mlp = range(rank * inter // world, (rank + 1) * inter // world)
    gate_up = [mlp, range(inter + mlp.start, inter + mlp.stop)]
    return LayerCuts({"gate_up_proj": gate_up}, {"down_proj": mlp})


def layer_cuts(
    head_dim: int, q_size: int, kv_size: int, inter: int, split: HeadSplit, rank: int, world: int
) -> LayerCuts:
    a, m = attention_cuts(head_dim, q_size, kv_size, split), mlp_cuts(inter, rank, world)
    return LayerCuts({**a.rows, **m.rows}, {**a.cols, **m.cols})


def _cut(owner: torch.nn.Module, cuts: LayerCuts, where: str) -> None:
    """Replaces each of owner's weights that `cuts` names with this rank's share of it."""
    for name, parts in cuts.rows.items():
        replace_weight(owner, name, take_rows(getattr(owner, name), parts, f"{where}'s {name}"))
    for name, cols in cuts.cols.items():
        replace_weight(owner, name, take_cols(getattr(owner, name), cols, f"{where}'s {name}"))


def _shard_layer(layer: DecoderLayer, index: int, split: HeadSplit, rank: int, world: int) -> None:
    d, q_size, kv_size = layer.head_dim, layer.q_size, layer.kv_size
    where = f"layer {index}"
    attention = attention_cuts(d, q_size, kv_size, split)
    _cut(layer, attention, where)
    moe, down = layer.moe, layer._weights[5]
    if moe is None:
        assert down is not None  # (a dense MLP's)
        _cut(layer, mlp_cuts(down.shape[1], rank, world), where)
    else:  # each expert, and the shared one, as an MLP; the router whole
        experts = [(f"expert {e}", x) for e, x in enumerate(moe.experts)]
        for what, expert in experts + ([("shared expert", moe.shared)] if moe.shared else []):
            assert isinstance(expert, Expert)
            _cut(expert, mlp_cuts(expert.down_proj.shape[1], rank, world), f"{where}'s {what}")
    if layer._qkv_bias is not None:  # cut as qkv_proj's rows; q/k norms are per head: kept whole
        bias = take_rows(layer._qkv_bias, attention.rows["qkv_proj"], f"layer {index}'s qkv_bias")
        replace_weight(layer, "qkv_bias", bias)
    layer.num_heads, layer.num_kv_heads = split.num_heads, split.num_kv_heads
    layer.q_size, layer.kv_size = split.num_heads * d, split.num_kv_heads * d


def lora_cut(config: LlamaConfig, rank: int, world: int) -> LoRACut:
    """Rank's share of every adapter, cut where the base weights are: B's output columns of the
    column-parallel parts, A's input features of the row-parallel o and down (their deltas are
    partial sums too, added before the all-reduce)."""
    c = config
    split = split_heads(c.num_attention_heads, c.num_key_value_heads, rank, world)
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size
    cuts = layer_cuts(c.head_dim, q_size, kv_size, inter, split, rank, world)
    starts = {"qkv_proj": [0, q_size, q_size + kv_size], "gate_up_proj": [0, inter]}
    outputs = {
        (name.removesuffix("_proj"), part): range(r.start - start, r.stop - start)
        for name, parts in cuts.rows.items()
        for part, (r, start) in enumerate(zip(parts, starts[name], strict=True))
    }
    return LoRACut(outputs, {name.removesuffix("_proj"): r for name, r in cuts.cols.items()})


def shard_model(
    model: LlamaForCausalLM, rank: int, world: int, all_reduce: Callable[[Tensor], None]
) -> HeadSplit:
    """Cut every layer of a loaded model down to rank's shard, in place, then pack what a
    pack=False load left as GGUF blocks; returns the head split."""
    c = model.config
    check_shardable(c, world)
    split = split_heads(c.num_attention_heads, c.num_key_value_heads, rank, world)
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    if any(layer.all_reduce is not None for layer in layers):
        raise ConfigError("this model is split for tensor parallelism already: load it again")
    with torch.no_grad():
        for i, layer in enumerate(layers):
            _shard_layer(layer, i, split, rank, world)
        model.pack_weights()  # also refreshes every layer's weight references
        finish_weights(model)
    for layer in layers:
        layer.__dict__["all_reduce"] = all_reduce
    return split

"""LoRA adapters (vLLM's --enable-lora --lora-modules): PEFT folders, added to the base model's
matmuls for the rows of the requests that name them.

An adapter changes a projection W to W + s * B @ A (A: [r, in], B: [out, r], s = alpha / r, or
alpha / sqrt(r) with rsLoRA). The base weights stay as they are (quantized, packed, shared by every
request); each step, for each adapter's rows, x @ A^T then @ B^T is added to the projection's
output. The model's fused projections (qkv, gate_up) take their parts' A stacked and their Bs as
one block-diagonal matrix: two matmuls a projection, however many parts it has (torch's per-call
cost, not the FLOPs, is what a small rank spends).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pagedkv.config import ConfigError
from pagedkv.model.config import LlamaConfig
from pagedkv.model.llama import FUSED_PARTS

# PEFT's module names (q_proj, ...) -> (our fused projection, its part): as the loader fuses them
TARGETS = {
    hf.rpartition(".")[2]: (fused.removesuffix("_proj"), part)
    for hf, (fused, part) in FUSED_PARTS.items()
    if fused.endswith("_proj")
}


@dataclass
class Projection:
    """One fused projection of one layer under an adapter."""

    a: Tensor  # [sum of the parts' ranks, in]: the parts' A stacked
    b: Tensor  # [out, sum of the ranks]: the parts' B, scaled, block-diagonal (zero elsewhere)

    def add(self, x: Tensor, out: Tensor, rows: slice | Tensor) -> None:
        """out[rows] += x[rows]'s delta under this adapter, in place."""
        xa = x[rows] @ self.a.T
        if isinstance(rows, slice):
            out[rows].addmm_(xa, self.b.T)
        else:
            out.index_add_(0, rows, xa @ self.b.T)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    key: str = ""  # keys its prefix-cache blocks: name and a fingerprint of its files
    layers: list[dict[str, Projection]] = field(default_factory=list)  # per layer: target -> it


def _shapes(config: LlamaConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused projection's input width and its parts' output widths."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]), "gate_up": (hidden, [inter, inter]),
            "down": (inter, [hidden])}  # fmt: skip


def load_adapter(
    name: str, path: str, config: LlamaConfig, dtype: torch.dtype, max_rank: int
) -> LoRAAdapter:
    """A PEFT folder (adapter_config.json, adapter_model.safetensors) for this base model; what it
    cannot apply exactly (biases, DoRA, extra trained modules, a rank over max_rank, another
    shape) is a ConfigError naming it."""
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    where = f"LoRA adapter {name!r} ({path})"
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: no readable adapter_config.json ({e})") from None
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ConfigError(f"{where}: no adapter_model.safetensors")
    for key, ok in (
        ("bias", cfg.get("bias", "none") == "none"),
        ("use_dora", not cfg.get("use_dora")),
        ("modules_to_save", not cfg.get("modules_to_save")),
        ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
    ):
        if not ok:
            raise ConfigError(f"{where}: {key}={cfg.get(key)!r} is not supported")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if rank > max_rank:
        raise ConfigError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    digest = hashlib.blake2b(weights_file.read_bytes(), digest_size=16)
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    tensors = load_file(str(weights_file))
    found: dict[tuple[int, str], dict[int, tuple[Tensor, Tensor]]] = {}
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        stem, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ConfigError(f"{where}: unsupported tensor {key!r}")
        pairs.setdefault(stem, {})[kind[0]] = t
    for stem, ab in pairs.items():
        names = stem.split(".")
        module = names[-1]
        if module not in TARGETS or "layers" not in names or len(ab) != 2:
            raise ConfigError(f"{where}: unsupported module {stem!r}")
        layer = int(names[names.index("layers") + 1])
        if not 0 <= layer < config.num_hidden_layers:
            raise ConfigError(f"{where}: {stem!r} is past the model's layers")
        target, part = TARGETS[module]
        found.setdefault((layer, target), {})[part] = (ab["A"], ab["B"])
    shapes = _shapes(config)
    layers: list[dict[str, Projection]] = [{} for _ in range(config.num_hidden_layers)]
    adapter = LoRAAdapter(name, str(path), rank, f"{name}\0{digest.hexdigest()}", layers)
    for (layer, target), by_part in found.items():
        fan_in, widths = shapes[target]
        a_rows: list[Tensor] = []
        b_parts: list[tuple[int, int, Tensor]] = []  # (first output column, first rank, B)
        at = 0
        for part, (a, b) in sorted(by_part.items()):
            width = widths[part]
            if a.shape[1] != fan_in or b.shape[0] != width or a.shape[0] != b.shape[1]:
                raise ConfigError(
                    f"{where}: layer {layer} {target} part {part}: A {tuple(a.shape)}, "
                    f"B {tuple(b.shape)} do not fit the model"
                )
            a_rows.append(a)
            b_parts.append((sum(widths[:part]), at, b))
            at += a.shape[0]
        b_full = torch.zeros(sum(widths), at)
        for col, rank, b in b_parts:
            b_full[col : col + b.shape[0], rank : rank + b.shape[1]] = b.float() * scale
        adapter.layers[layer][target] = Projection(torch.cat(a_rows).to(dtype), b_full.to(dtype))
    return adapter


@dataclass
class LoRABatch:
    """A step's rows under each adapter: a slice where they are one run, else their indices (one
    gather and one matmul per adapter, however its rows interleave with others'); rows under
    none are the base model's."""

    rows: list[tuple[LoRAAdapter, slice | Tensor]]

    @classmethod
    def of(cls, spans: list[tuple[LoRAAdapter, int, int]]) -> LoRABatch:
        """From (adapter, first row, end row) spans in row order."""
        by: dict[str, tuple[LoRAAdapter, list[tuple[int, int]]]] = {}
        for adapter, lo, hi in spans:
            by.setdefault(adapter.name, (adapter, []))[1].append((lo, hi))
        rows: list[tuple[LoRAAdapter, slice | Tensor]] = []
        for adapter, parts in by.values():
            if all(a[1] == b[0] for a, b in zip(parts, parts[1:])):
                rows.append((adapter, slice(parts[0][0], parts[-1][1])))
            else:
                rows.append((adapter, torch.cat([torch.arange(lo, hi) for lo, hi in parts])))
        return cls(rows)

    def add(self, layer: int, target: str, x: Tensor, out: Tensor) -> None:
        for adapter, rows in self.rows:
            proj = adapter.layers[layer].get(target)
            if proj is not None:
                proj.add(x, out, rows)

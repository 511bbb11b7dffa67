"""LoRA adapters (vLLM's --enable-lora --lora-modules): PEFT folders, added to the base model's
matmuls for the rows of the requests that name them.

An adapter changes a projection W to W + s * B @ A (A: [r, in], B: [out, r], s = alpha / r, or
alpha / sqrt(r) with rsLoRA). The base weights stay as they are (quantized, packed, shared by every
request); each step, x @ A^T @ B^T is added to the output columns of each part of a fused
projection (q, k, v of qkv; gate, up of gate_up) for the rows of the requests under an adapter.
One C++ call a part serves every adapter's rows (csrc/layer_ops.cpp, `lora`): torch's two small
matmuls a projection and adapter cost ~90 us, four times their arithmetic (BENCHMARKS.md "LoRA
adapters"); without the library, the same in torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pagedkv import native
from pagedkv.config import ConfigError
from pagedkv.model.config import LlamaConfig
from pagedkv.model.llama import FUSED_PARTS, FUSED_WHOLE

# PEFT's module names (q_proj, ...) -> (our fused projection, its part): as the loader fuses them
TARGETS = {
    hf.rpartition(".")[2]: (fused.removesuffix("_proj"), part)
    for hf, (fused, part) in FUSED_PARTS.items()
    if fused.endswith("_proj")
}

# and the names of projections a checkpoint holds fused already (Phi-3's qkv_proj, gate_up_proj):
# their B, whose rows span every part, is cut into the parts' rows, each beside the same A
WHOLE_TARGETS = {
    hf.rpartition(".")[2]: fused.removesuffix("_proj") for hf, fused in FUSED_WHOLE.items()
}

# the modules of the attention (all an adapter may change on a mixture of experts' layer)
ATTENTION_TARGETS = {m for m, (fused, _) in TARGETS.items() if fused in ("qkv", "o")} | {"qkv_proj"}

# what a PEFT name may hold before the decoder's `layers` (a multimodal model's text part too)
_DECODER_PATH = {"base_model", "model", "language_model"}


@dataclass
class Delta:
    """One part of a projection under one adapter: its output columns gain x @ a^T @ b."""

    a: Tensor  # [rank, in]
    b: Tensor  # [rank, width]: the adapter's B transposed, its scale folded in


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    key: str = ""  # keys its prefix-cache blocks: name and a fingerprint of its files
    # per layer: (fused projection, part) -> its delta, as llama.FUSED_PARTS numbers the parts
    layers: list[dict[tuple[str, int], Delta]] = field(default_factory=list)
    parent: str | None = None  # the base model's name /v1/models gives (None: the served one)


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
    shapes = _shapes(config)
    for key, t in tensors.items():
        stem, _, kind = key.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ConfigError(f"{where}: unsupported tensor {key!r}")
        pairs.setdefault(stem, {})[kind[0]] = t
    for stem, ab in pairs.items():
        names = stem.split(".")
        module = names[-1]
        if (
            (module not in TARGETS and module not in WHOLE_TARGETS)
            or "layers" not in names
            or len(ab) != 2
            or not set(names[: names.index("layers")]) <= _DECODER_PATH  # (a vision tower's)
        ):
            raise ConfigError(f"{where}: unsupported module {stem!r}")
        layer = int(names[names.index("layers") + 1])
        if not 0 <= layer < config.num_hidden_layers:
            raise ConfigError(f"{where}: {stem!r} is past the model's layers")
        if config.layer_moe(layer) and module not in ATTENTION_TARGETS:
            raise ConfigError(
                f"{where}: {stem!r}: layer {layer} is a mixture of experts, whose experts take no "
                "adapter (its attention does)"
            )
        if module in TARGETS:
            target, part = TARGETS[module]
            split = {part: (ab["A"], ab["B"])}
        else:  # (Phi-3's fused qkv_proj / gate_up_proj)
            target = WHOLE_TARGETS[module]
            widths = shapes[target][1]
            if ab["B"].shape[0] != sum(widths):
                raise ConfigError(
                    f"{where}: {stem!r}: B has {ab['B'].shape[0]} rows, the projection "
                    f"{sum(widths)}"
                )
            split = {i: (ab["A"], rows) for i, rows in enumerate(ab["B"].split(widths))}
        parts = found.setdefault((layer, target), {})
        if parts.keys() & split.keys():
            raise ConfigError(f"{where}: layer {layer} {target}: a part given twice ({stem!r})")
        parts.update(split)
    layers: list[dict[tuple[str, int], Delta]] = [{} for _ in range(config.num_hidden_layers)]
    adapter = LoRAAdapter(name, str(path), rank, f"{name}\0{digest.hexdigest()}", layers)
    for (layer, target), by_part in found.items():
        fan_in, widths = shapes[target]
        for part, (a, b) in sorted(by_part.items()):
            if a.shape[1] != fan_in or b.shape[0] != widths[part] or a.shape[0] != b.shape[1]:
                raise ConfigError(
                    f"{where}: layer {layer} {target} part {part}: A {tuple(a.shape)}, "
                    f"B {tuple(b.shape)} do not fit the model"
                )
            b_scaled = (b.float() * scale).T.contiguous().to(dtype)
            adapter.layers[layer][(target, part)] = Delta(a.to(dtype).contiguous(), b_scaled)
    return adapter


@dataclass
class PartTable:
    """One part of one layer's projection over the loaded adapters (slot i: adapter i): where its
    columns are, and each adapter's delta there with the addresses the kernel reads."""

    cols: int  # first output column of the part in the fused projection
    width: int
    deltas: list[Delta | None]  # by slot; None where the adapter leaves the part alone
    a: Tensor  # int64 [adapters]: each delta's A address (0: none)
    b: Tensor  # int64 [adapters]
    ranks: Tensor  # int32 [adapters]: 0 where none

    @classmethod
    def of(cls, cols: int, width: int, deltas: list[Delta | None]) -> PartTable:
        def addresses(pick) -> Tensor:
            return torch.tensor([0 if d is None else pick(d).data_ptr() for d in deltas])

        ranks = torch.tensor([0 if d is None else d.a.shape[0] for d in deltas], dtype=torch.int32)
        return cls(cols, width, deltas, addresses(lambda d: d.a), addresses(lambda d: d.b), ranks)


@dataclass(frozen=True)
class LoRACut:
    """A tensor-parallel rank's share of each delta (distributed/shard.py `lora_cut`): the columns
    of each column-parallel part it keeps, within the part, and the input features of each
    row-parallel projection it reads."""

    outputs: dict[tuple[str, int], range]  # (projection, part) -> columns of B^T
    inputs: dict[str, range]  # projection -> columns of A

    def width(self, target: str, part: int, width: int) -> int:
        cols = self.outputs.get((target, part))
        return width if cols is None else len(cols)

    def delta(self, target: str, part: int, d: Delta) -> Delta:
        cols, features = self.outputs.get((target, part)), self.inputs.get(target)
        a = d.a if features is None else d.a[:, features.start : features.stop].contiguous()
        b = d.b if cols is None else d.b[:, cols.start : cols.stop].contiguous()
        return Delta(a, b)


@dataclass
class LoRATables:
    """Every loaded adapter's deltas, by layer and fused projection: what a step reads. Built
    again when an adapter is added or removed (slots follow the order of loading)."""

    adapters: list[LoRAAdapter]
    layers: list[dict[str, list[PartTable]]]  # per layer: projection -> the parts adapters change

    @classmethod
    def of(
        cls, adapters: list[LoRAAdapter], config: LlamaConfig, cut: LoRACut | None = None
    ) -> LoRATables:
        """`cut`: this tensor-parallel rank's share (None: the whole model)."""
        layers: list[dict[str, list[PartTable]]] = []
        for i in range(config.num_hidden_layers):
            by_target: dict[str, list[PartTable]] = {}
            for target, (_, full) in _shapes(config).items():
                widths = [w if cut is None else cut.width(target, p, w) for p, w in enumerate(full)]
                for part, width in enumerate(widths):
                    deltas = [a.layers[i].get((target, part)) for a in adapters]
                    if cut is not None:
                        deltas = [d and cut.delta(target, part, d) for d in deltas]
                    if any(d is not None for d in deltas):
                        table = PartTable.of(sum(widths[:part]), width, deltas)
                        by_target.setdefault(target, []).append(table)
            layers.append(by_target)
        return cls(list(adapters), layers)


@dataclass
class LoRABatch:
    """A step's rows under adapters: each row's slot in `tables` (-1: the base model's)."""

    tables: LoRATables
    slots: Tensor  # int32 [rows]

    @staticmethod
    def slots_of(spans: list[tuple[int, int, int]], rows: int) -> Tensor:
        """Each row's slot from (slot, first row, end row) spans of a step of `rows` rows."""
        slots = [-1] * rows
        for slot, lo, hi in spans:
            slots[lo:hi] = [slot] * (hi - lo)
        return torch.tensor(slots, dtype=torch.int32)

    def add(self, layer: int, target: str, x: Tensor, out: Tensor) -> None:
        """out (a fused projection's output for x) += every row's delta under its adapter."""
        lib = native.library_for(x, out)
        for part in self.tables.layers[layer].get(target, ()):
            view = out[:, part.cols : part.cols + part.width]
            if lib is None:
                self._add_torch(part, x, view)
                continue
            lib.call(
                "lora",
                dtype=native.DTYPES[x.dtype],
                x=x.data_ptr(),
                x_stride=x.stride(0),
                out=view.data_ptr(),
                out_stride=out.stride(0),
                slots=self.slots.data_ptr(),
                a=part.a.data_ptr(),
                b=part.b.data_ptr(),
                ranks=part.ranks.data_ptr(),
                adapters=len(part.deltas),
                rows=x.shape[0],
                k=x.shape[1],
                n=part.width,
                threads=torch.get_num_threads(),
            )

    def _add_torch(self, part: PartTable, x: Tensor, out: Tensor) -> None:
        """The kernel's arithmetic in torch (float32 sums, one rounding), its reference."""
        for slot, delta in enumerate(part.deltas):
            rows = (self.slots == slot).nonzero().squeeze(1)
            if delta is None or not len(rows):
                continue
            xa = x[rows].float() @ delta.a.float().T
            out[rows] = (out[rows].float() + xa @ delta.b.float()).to(out.dtype)

"""Turn a scheduled batch into tensors, run the model once, return the logits to sample.

The batch is flat (varlen): every sequence's new tokens are concatenated, and
the attention metadata says where each sequence's rows start, how long its
context is, where its new K/V go (slot mapping) and which blocks hold the
rest (block tables). Block copies planned by the scheduler (swap out, copy on
write, swap in) are applied first, in that order; with a KV offload tier, its
reads come before them (evicted blocks are saved before being overwritten) and
its writes after (prefix blocks loaded back, saved blocks put in the tier), and
the blocks a step filled are written through to its disk tier after the step.
With tensor parallelism, rank 0 sends the block moves (with the tiers' saves and
loads), each forward's inputs, the write-throughs and the loaded LoRA adapters to
the other ranks; every rank moves its own blocks in its own tiers and runs its
shard (`pagedkv.distributed.tiers`), with its share of each adapter.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedkv.attention.paged import AttentionMetadata
from pagedkv.engine import pooling
from pagedkv.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.plan import BlockLoad, BlockSave
from pagedkv.kvstore.offload import KVOffload
from pagedkv.kvstore.storage import KVStorage
from pagedkv.model.decode_graph import DecodeGraphs
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.lora import LoRAAdapter, LoRABatch, LoRACut, LoRATables

if TYPE_CHECKING:
    from pagedkv.distributed.group import TensorParallelGroup


@dataclass
class BlockMoves:
    """A step's block copies (src, dst), applied in this order before its forward, and the
    offload tiers' saves (read before them) and loads (written after them)."""

    swap_out: list[tuple[int, int]]
    copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    saves: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.copies or self.swap_in or self.saves or self.loads)


@dataclass
class DiskWrites:
    """The blocks a forward filled, for every tensor-parallel rank's disk tier."""

    writes: list[BlockSave]


@dataclass
class ForwardInputs:
    """One forward's inputs: what every tensor-parallel rank needs besides its own weights and
    K/V."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    lora_slots: torch.Tensor | None = None  # int32, each row's adapter (LoRABatch), -1: none


@dataclass
class LoRASync:
    """The adapters rank 0 has loaded, in slot order, for the other ranks: those they have not
    seen in full, the others by name."""

    names: list[str]
    added: dict[str, LoRAAdapter]


class ModelRunner:
    """`kv` (the block manager) and `offload` live in rank 0 only; `tp` is rank 0's link to the
    other ranks."""

    def __init__(
        self,
        model,
        storage: KVStorage,
        host_storage: KVStorage | None,
        device: torch.device,
        kv: KVCacheManager | None = None,
        offload: KVOffload | None = None,
        tp: TensorParallelGroup | None = None,
        eager: bool = False,
        loras: dict[str, LoRAAdapter] | None = None,
        lora_cut: LoRACut | None = None,
    ) -> None:
        """eager: never replay decode steps from recorded kernel calls (--enforce-eager); loras:
        the engine's adapters by name (whole: `lora_cut` is this rank's share of them)."""
        self.loras = loras if loras is not None else {}
        self.lora_cut = lora_cut
        self._lora_tables: LoRATables | None = None  # built at the first step with an adapter
        self._lora_sent: dict[str, LoRAAdapter] = {}  # what the other ranks hold (rank 0)
        self.model = model
        self.storage = storage
        self.host_storage = host_storage
        self.kv = kv
        self.block_size = storage.block_size
        self.device = device
        self.offload = offload
        self.tp = tp
        # (a mixture of experts routes with torch ops, whose shapes change with the routing: never
        # replayable, so not recorded)
        replay = (
            not eager
            and tp is None
            and isinstance(model, LlamaForCausalLM)
            and not model.config.num_experts
        )
        self.graphs = DecodeGraphs(model, storage.kv_caches) if replay else None

    def apply_copies(self, out: SchedulerOutput) -> None:
        moves = BlockMoves(
            [(c.src, c.dst) for c in out.swap_out],
            [(c.src, c.dst) for c in out.copies],
            [(c.src, c.dst) for c in out.swap_in],
            out.offload_saves,
            out.offload_loads,
        )
        if self.tp is not None and moves:
            self.tp.send(moves)
        self.apply_moves(moves)

    def apply_moves(self, moves: BlockMoves) -> None:
        offload = self.offload
        staged = offload.stage(self.storage, moves.saves, moves.loads) if offload else None
        self.move_blocks(moves)
        if offload is not None and staged is not None:
            offload.commit(self.storage, staged)

    def move_blocks(self, moves: BlockMoves) -> None:
        host = self.host_storage  # the scheduler swaps only with host blocks
        if moves.swap_out:
            assert host is not None
            data = self.storage.read_blocks([src for src, _ in moves.swap_out])
            host.write_blocks([dst for _, dst in moves.swap_out], data)
        if moves.copies:
            self.storage.copy_blocks(moves.copies)
        if moves.swap_in:
            assert host is not None
            data = host.read_blocks([src for src, _ in moves.swap_in])
            self.storage.write_blocks([dst for _, dst in moves.swap_in], data)

    def run_model(self, inputs: ForwardInputs) -> torch.Tensor:
        """The step's hidden states: replayed (decode_graph.py) where it can be, else eagerly."""
        slots = inputs.lora_slots
        lora = None if slots is None else LoRABatch(self.lora_tables(), slots)
        if self.graphs is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, lora)
            if hidden is not None:
                return hidden
        return self.model(
            inputs.input_ids, inputs.positions, self.storage.kv_caches, inputs.meta, lora
        )

    def run(self, item: BlockMoves | ForwardInputs | DiskWrites | LoRASync) -> None:
        """A worker rank's share of what rank 0 sent."""
        if isinstance(item, BlockMoves):
            self.apply_moves(item)
        elif isinstance(item, DiskWrites):
            self.write_through(item.writes)
        elif isinstance(item, LoRASync):
            self.loras = {n: item.added.get(n) or self.loras[n] for n in item.names}
        else:
            self.run_model(item)

    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Inputs for one forward; also the rows whose logits are sampled (last row of each sampling
        seq)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        kv = self.kv
        assert kv is not None  # rank 0 prepares the inputs
        for s in scheduled:
            seq, n = s.seq, s.num_new_tokens + len(s.drafts)
            start = seq.num_computed_tokens
            table = kv.block_table(seq.seq_id)
            tokens.extend(seq.token_ids[start : start + s.num_new_tokens])
            tokens.extend(s.drafts)
            pos = np.arange(start, start + n, dtype=np.int64)
            positions.append(pos)
            slots.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            if s.samples:  # the last known token's row, then one row per draft
                sample_rows.extend(range(len(tokens) - 1 - len(s.drafts), len(tokens)))
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = t
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            block_size=bs,
            is_decode=all(q == 1 for q in query_lens),
            window=self.model.config.sliding_window or 0,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos_t, meta, sample_rows

    def lora_tables(self) -> LoRATables:
        """The loaded adapters' deltas (this rank's share), built again when one was added or
        removed."""
        tables = self._lora_tables
        loaded = list(self.loras.values())
        if tables is None or list(map(id, tables.adapters)) != list(map(id, loaded)):
            tables = LoRATables.of(loaded, self.model.config, self.lora_cut)
            self._lora_tables = tables
            if self.graphs is not None:
                self.graphs.forget_lora_graphs()  # they read the old tables
        return tables

    def sync_loras(self) -> None:
        """Rank 0: the other ranks load and unload what this one has, before the next forward."""
        assert self.tp is not None
        sent = self._lora_sent
        if [(n, id(a)) for n, a in sent.items()] == [(n, id(a)) for n, a in self.loras.items()]:
            return
        added = {n: a for n, a in self.loras.items() if sent.get(n) is not a}
        self.tp.send(LoRASync(list(self.loras), added))
        self._lora_sent = dict(self.loras)

    def lora_runs(self, scheduled: list[ScheduledSeq]) -> torch.Tensor | None:
        """Each row's adapter slot, as its sequence names it (None when no row has one)."""
        if self.tp is not None:
            self.sync_loras()
        if not self.loras:  # no adapter loaded: nothing to look at in the step
            return None
        slot_of = {adapter.name: i for i, adapter in enumerate(self.lora_tables().adapters)}
        spans = []
        row = 0
        for s in scheduled:
            n = s.num_new_tokens + len(s.drafts)
            name = s.seq.params.lora_name
            if name is not None:
                spans.append((slot_of[name], row, row + n))
            row += n
        return LoRABatch.slots_of(spans, row) if spans else None

    @staticmethod
    def attach_prompt_hidden(scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """A request asking for prompt_logprobs gets the hidden rows of its unscored prompt; an
        embedding request, what its pooling takes of them."""
        row = 0
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            if seq.group.pooled is not None:
                rows = hidden[row : row + s.num_new_tokens]
                pooling.add_rows(seq.group.pooled, start, rows, seq.num_prompt_tokens)
            if seq.params.prompt_logprobs is not None:
                first = max(start, len(seq.group.prompt_logprobs))
                last = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)
                if first < last:
                    rows = hidden[row + first - start : row + last - start]
                    s.prompt_hidden = (first, rows.clone())  # (hidden may be a graph's buffer)
            row += s.num_new_tokens + len(s.drafts)

    def write_through(self, writes: list[BlockSave], skip: Set[int] = frozenset()) -> None:
        """Queue the blocks the step filled for the disk tier, less those a failed request left
        unwritten (`skip`)."""
        writes = [w for w in writes if w.block_id not in skip]
        if writes:
            assert self.offload is not None  # writes come only from a disk tier
            if self.tp is not None:
                self.tp.send(DiskWrites(writes))
            self.offload.write_through(self.storage, writes)

    def forward(self, scheduled: list[ScheduledSeq]) -> torch.Tensor | None:
        """The model over these sequences' new tokens (block copies already applied).

        Separate from `execute` so the engine can run part of a step's batch again when it failed.
        With tensor parallelism a failed forward leaves the ranks out of step: it is fatal.
        """
        if not scheduled:
            return None
        input_ids, positions, meta, rows = self.prepare(scheduled)
        inputs = ForwardInputs(input_ids, positions, meta, self.lora_runs(scheduled))
        if self.tp is None:
            hidden = self.run_model(inputs)
        else:
            self.tp.send(inputs)
            try:
                hidden = self.run_model(inputs)
            except Exception as e:
                raise self.tp.error(e) from e
        self.attach_prompt_hidden(scheduled, hidden)
        if not rows:
            return None
        return self.model.compute_logits(hidden[rows]).float().cpu()

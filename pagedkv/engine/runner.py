"""Turn a scheduled batch into tensors, run the model once, return the logits to sample.

The batch is flat (varlen): every sequence's new tokens are concatenated, and
the attention metadata says where each sequence's rows start, how long its
context is, where its new K/V go (slot mapping) and which blocks hold the
rest (block tables). Block copies planned by the scheduler (swap out, copy on
write, swap in) are applied first, in that order; with a KV offload tier, its
reads come before them (evicted blocks are saved before being overwritten) and
its writes after (prefix blocks loaded back, saved blocks put in the tier), and
the blocks the forward filled are written through to its disk tier after it.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedkv.attention.paged import AttentionMetadata
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.offload import KVOffload
from pagedkv.kv.storage import KVStorage


class ModelRunner:
    def __init__(self, model, storage: KVStorage, host_storage: KVStorage | None, kv: KVCacheManager,
                 device: torch.device, offload: KVOffload | None = None) -> None:
        self.model = model
        self.storage = storage
        self.host_storage = host_storage
        self.kv = kv
        self.block_size = kv.block_size
        self.device = device
        self.offload = offload

    def apply_copies(self, out: SchedulerOutput) -> None:
        staged = self.offload.stage(self.storage, out.offload_saves, out.offload_loads) if self.offload else None
        if out.swap_out:
            ids = [c.src for c in out.swap_out]
            self.host_storage.write_blocks([c.dst for c in out.swap_out], self.storage.read_blocks(ids))
        if out.copies:
            self.storage.copy_blocks([(c.src, c.dst) for c in out.copies])
        if out.swap_in:
            data = self.host_storage.read_blocks([c.src for c in out.swap_in])
            self.storage.write_blocks([c.dst for c in out.swap_in], data)
        if staged is not None:
            self.offload.commit(self.storage, staged)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Inputs for one forward; also the rows whose logits are sampled (last row of each sampling seq)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for s in out.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            table = self.kv.block_table(seq.seq_id)
            tokens.extend(seq.token_ids[start:start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            positions.append(pos)
            slots.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            if s.samples:
                sample_rows.append(len(tokens) - 1)
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
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
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        return input_ids, pos_t, meta, sample_rows

    def execute(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Run one step; returns float32 logits [num sampling seqs, vocab] (None if nothing samples)."""
        self.apply_copies(out)
        if not out.scheduled:
            return None
        input_ids, positions, meta, rows = self.prepare(out)
        hidden = self.model(input_ids, positions, self.storage.kv_caches, meta)
        logits = self.model.compute_logits(hidden[rows]).float().cpu() if rows else None
        if out.offload_writes:
            self.offload.write_through(self.storage, out.offload_writes)
        return logits

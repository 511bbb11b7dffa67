"""Decode graphs: a decode step's kernel calls recorded once, then replayed by one C++ call.

A decode step of the default model makes ~300 C++ kernel calls, and between them Python builds
each call's arguments: 8 ms of a 105 ms step at 64 sequences and 5 ms of an 11.5 ms single-stream
step, measured (BENCHMARKS.md). The calls of two steps of the same shape differ only in the
contents of a few index tensors (positions, slots, sequence lengths, block tables, the cascade
plan, the query starts) and in the plan's group count. So, as vLLM does with CUDA graphs, the
first step of each shape (tokens, sequences, with a cascade plan or not) of at most MAX_TOKENS
tokens (decode steps, and speculative verify steps of a few tokens a sequence) runs the model
with its inputs in tensors kept for the purpose, writing every intermediate result into buffers
kept with them (llama.ForwardBuffers), while the library records each kernel call with its
parameter struct (native.Library.record); later steps of that shape copy their inputs into those
tensors, set the group count, and run the recorded calls again in C++ (csrc/graph.cpp,
native.KernelGraph). Same kernels, same order, same arguments: the same result, bit for bit.

Only a forward made entirely of our kernels can be replayed: while recording, any torch op that
computes (anything but a view) marks the forward as not replayable (an int8 or int4 matmul on
torch's kernel, a bf16 one on oneDNN's where our bf16 GEMM does not run, a float16 model's, the
torch paths), and steps of that shape run eagerly from then on. (A quantized KV cache replays:
its rotation runs inside the kernels that write and read it.) The kernels read only
the metadata's tensors, never its Python lists (the torch paths do). A step with LoRA adapters
replays too: its rows' adapter slots are one more input, and the adapters' tables are part of its
key (replaced, and their graphs dropped, when an adapter is added or removed). Tensor parallelism
runs eagerly too (its all-reduce is not a kernel of ours), as do a mixture of experts (its
routing is torch's) and `--enforce-eager`.
"""

from __future__ import annotations

import ctypes
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from pagedkv import native
from pagedkv.attention.cascade import CascadePlan
from pagedkv.attention.paged import AttentionMetadata, Cache, cascade_plan
from pagedkv.model.llama import ForwardBuffers, LlamaForCausalLM
from pagedkv.model.lora import LoRABatch

log = logging.getLogger("pagedkv")

MAX_TOKENS = 256  # the largest step recorded (more is a prompt: its matmuls dwarf the calls)
MAX_GRAPHS = 128  # shapes kept (least recently used dropped), ~60 KB of parameter structs each


class NotReplayable(Exception):
    """The forward ran a torch op that computes: its kernel calls alone do not make the step."""


class _ViewsOnly(TorchDispatchMode):
    """Raises NotReplayable at the first torch op that is not a view (the kernels write through
    pointers, unseen by torch; any other op's result would not be recomputed by a replay)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch.compile runs under this mode: leave __torch_dispatch__ unwrapped (the wrapper
        imports torch._dynamo at its first call, 1.5 s here)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            raise NotReplayable(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class _Arena:
    """The tensors every graph's forward runs in, MAX_TOKENS rows each; a graph of T tokens uses
    their first T rows. One step runs at a time, and its result (in buffers.h) is used before
    the next step: so all graphs share them (8 MB for the default model)."""

    x: Tensor  # [MAX_TOKENS, hidden] embeddings in, then the residual stream
    positions: Tensor  # [MAX_TOKENS] int64
    slots: Tensor  # [MAX_TOKENS] int64
    adapters: Tensor  # [MAX_TOKENS] int32: each row's LoRA adapter slot (a step with adapters)
    buffers: ForwardBuffers


@dataclass
class _Graph:
    """One shape's recorded step and the tensors its kernels read and write."""

    x: Tensor  # [T, hidden] (the arena's rows)
    positions: Tensor  # [T]
    slots: Tensor  # [T]
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor  # [B] int32
    block_tables: Tensor  # [B, width] int32
    plan: CascadePlan | None  # pre [B], group_start [B + 1], members [B] (int32, full size)
    lora: LoRABatch | None  # the adapters' tables its calls read, and the rows' slots [T]
    buffers: ForwardBuffers  # the arena's rows; the result lands in buffers.h [T, hidden]
    kernels: native.KernelGraph | None = None  # once recorded
    attention: list[ctypes.Structure] = field(default_factory=list)  # its paged_attention calls

    def fits(self, meta: AttentionMetadata) -> bool:
        return meta.block_tables.shape[1] <= self.block_tables.shape[1]


# A step's tokens, sequences, whether it has a cascade plan, torch's thread count (the kernels'
# splits, hence their sums' order, follow the threads they were given), and the LoRA tables its
# calls read (their id; 0 for a step without adapters: such a graph makes no LoRA calls).
Key = tuple[int, int, bool, int, int]


class DecodeGraphs:
    """The recorded steps of one model over one KV pool, by shape (Key)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[tuple[Cache, Cache]]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.lib = native.library()
        self.graphs: OrderedDict[Key, _Graph] = OrderedDict()
        self.arena: _Arena | None = None  # made at the first recording
        self.replayable = self.lib is not None and all(
            getattr(layer, "all_reduce", None) is None for layer in model.layers
        )
        # keys whose forward is not replayable (whether a matmul runs on torch's kernel may
        # depend on the rows: quant_linear's dense copies serve from a row count up)
        self.eager: set[Key] = set()

    def run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> Tensor | None:
        """The step's hidden states [T, hidden] (valid until the next step), or None when the
        step is too long or this model's forward cannot be replayed (the caller then runs it
        eagerly)."""
        tokens = input_ids.shape[0]
        if not self.replayable or tokens > MAX_TOKENS:
            return None
        plan = cascade_plan(meta)
        tables = 0 if lora is None else id(lora.tables)  # (a graph keeps its tables alive)
        key = (tokens, meta.seq_lens.shape[0], plan is not None, torch.get_num_threads(), tables)
        if key in self.eager:
            return None
        graph = self.graphs.get(key)
        if graph is None or not graph.fits(meta):
            return self._record(key, input_ids, positions, meta, plan, lora)
        self.graphs.move_to_end(key)
        self._load(graph, input_ids, positions, meta, plan, lora)
        kernels = graph.kernels
        assert kernels is not None  # (kept graphs are recorded ones)
        if plan is not None:
            for params in graph.attention:
                params.num_groups = plan.num_groups
        kernels.run()
        return graph.buffers.h

    def forget_lora_graphs(self) -> None:
        """Drop the graphs of steps with adapters: the adapters' tables they read were replaced
        (one was added or removed)."""
        for key in [k for k in self.graphs if k[4]]:
            del self.graphs[key]
        self.eager = {k for k in self.eager if not k[4]}

    def _load(
        self,
        graph: _Graph,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        plan: CascadePlan | None,
        lora: LoRABatch | None,
    ) -> None:
        """This step's inputs into the graph's tensors."""
        graph.x.copy_(self.model.embed(input_ids))
        if lora is not None and graph.lora is not None:
            graph.lora.slots.copy_(lora.slots)
        graph.positions.copy_(positions)
        graph.slots.copy_(meta.slot_mapping)
        if not meta.is_decode:
            graph.query_start_loc.copy_(meta.query_start_loc)
        graph.seq_lens.copy_(meta.seq_lens)
        graph.block_tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if plan is not None and graph.plan is not None:
            graph.plan.pre.copy_(plan.pre)
            graph.plan.group_start[: plan.num_groups + 1].copy_(plan.group_start)
            graph.plan.members[: plan.members.numel()].copy_(plan.members)

    def _new_graph(
        self, key: Key, width: int, plan: CascadePlan | None, lora: LoRABatch | None
    ) -> _Graph:
        """A graph's tensors for a step of this shape (its calls come when it is recorded)."""
        tokens, batch = key[:2]
        static_plan = None
        if plan is not None:
            static_plan = CascadePlan(
                torch.zeros(batch, dtype=torch.int32),
                torch.zeros(batch + 1, dtype=torch.int32),
                torch.zeros(batch, dtype=torch.int32),
            )
        if self.arena is None:
            model = self.model
            self.arena = _Arena(
                x=torch.empty(MAX_TOKENS, model.config.hidden_size, dtype=model.dtype),
                positions=torch.zeros(MAX_TOKENS, dtype=torch.int64),
                slots=torch.zeros(MAX_TOKENS, dtype=torch.int64),
                adapters=torch.full((MAX_TOKENS,), -1, dtype=torch.int32),
                buffers=ForwardBuffers.of(model, MAX_TOKENS),
            )
        arena = self.arena
        return _Graph(
            x=arena.x[:tokens],
            positions=arena.positions[:tokens],
            slots=arena.slots[:tokens],
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.zeros(batch, dtype=torch.int32),
            block_tables=torch.zeros(batch, width, dtype=torch.int32),
            plan=static_plan,
            lora=None if lora is None else LoRABatch(lora.tables, arena.adapters[:tokens]),
            buffers=arena.buffers.rows(tokens),
        )

    def _record(
        self,
        key: Key,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        plan: CascadePlan | None,
        lora: LoRABatch | None,
    ) -> Tensor | None:
        """Runs this step while recording its kernel calls; keeps them as its shape's graph when
        the forward was made of kernels alone. Returns the step's hidden states, or None
        (the step did not run) when it was not."""
        assert self.lib is not None
        old = self.graphs.pop(key, None)  # (a table grown past its width)
        width = max(meta.block_tables.shape[1], 0 if old is None else old.block_tables.shape[1])
        width = 1 << max(width - 1, 0).bit_length()  # room to grow: recorded again at most log2 x
        with torch.inference_mode(False):  # normal tensors: written in and out of inference mode
            graph = self._new_graph(key, width, plan, lora)
        self._load(graph, input_ids, positions, meta, plan, lora)
        static_meta = AttentionMetadata(
            slot_mapping=graph.slots,
            query_start_loc=graph.query_start_loc,
            seq_lens=graph.seq_lens,
            block_tables=graph.block_tables,
            query_lens=meta.query_lens,
            seq_lens_list=meta.seq_lens_list,
            block_size=meta.block_size,
            is_decode=meta.is_decode,
            window=meta.window,
        )
        static_plan = graph.plan
        if static_plan is not None:  # this step's plan, in the graph's tensors
            assert plan is not None
            starts, members = plan.group_start.numel(), plan.members.numel()
            static_plan = CascadePlan(
                static_plan.pre, static_plan.group_start[:starts], static_plan.members[:members]
            )
        static_meta._cache["cascade"] = static_plan
        try:
            with self.lib.record() as calls, _ViewsOnly():
                hidden = self.model.run_layers(
                    graph.x, graph.positions, self.kv_caches, static_meta, graph.buffers, graph.lora
                )
        except NotReplayable as e:
            # The kernels before the op ran (e.g. the first layer's K/V store): the eager
            # forward the caller now runs writes the same values again.
            log.info(
                "steps of %d tokens, %d sequences run eagerly: torch computes (%s)", *key[:2], e
            )
            self.eager.add(key)
            return None
        if hidden.data_ptr() != graph.buffers.h.data_ptr():
            self.eager.add(key)  # (cannot happen when no op but views ran)
            return None
        graph.kernels = self.lib.graph(calls)
        graph.attention = graph.kernels.structs("paged_attention")
        self.graphs[key] = graph
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return hidden

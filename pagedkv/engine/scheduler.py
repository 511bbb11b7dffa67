"""Continuous batching: which sequences run this step, and with how many tokens.

Every step forms one batch: the running sequences first, in admission order
(decodes take one token, prompts still being prefilled take a chunk), then
swapped-out sequences coming back, then new requests first come, first served.
When a running sequence needs a block and the pool is dry, the most recently
admitted sequence is preempted (recompute: free and requeue at the head;
swap: move its blocks to host memory). With the priority policy (vLLM's), the
queues and the running sequences are kept in order of (priority, arrival),
lower first, and the victim is the running sequence last in that order. The
scheduler decides; it never touches tensors: block copies go to the runner as
plans.

A beam search's live beams (engine/beam_search.py) sample together or not at all:
they sit side by side in `running`, are scheduled as one when all are running and
their tokens fit the step (until then a beam still being recomputed may take all
but its last token), and are preempted as one.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.engine.sequence import Sequence, SequenceGroup, Status
from pagedkv.engine.spec_decode import NgramProposer
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.plan import BlockCopy, BlockLoad, BlockSave
from pagedkv.kv.prefix import NO_PREFIX


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    drafts: list[int] = field(
        default_factory=list
    )  # speculative tokens after them (spec_decode.py)
    prompt_hidden: tuple | None = None  # (first position, hidden rows) for prompt_logprobs

    @property
    def completes(self) -> bool:
        """True when this step computes the sequence's last known token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)

    @property
    def samples(self) -> bool:
        """True when this step's last row is sampled: it completes the sequence, and the
        sequence generates (a pooling request ends with its prompt)."""
        return self.completes and self.seq.group.pooled is None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[BlockCopy] = field(default_factory=list)  # device -> host, done first
    copies: list[BlockCopy] = field(default_factory=list)  # device -> device (copy-on-write)
    swap_in: list[BlockCopy] = field(default_factory=list)  # host -> device
    offload_saves: list[BlockSave] = field(
        default_factory=list
    )  # evicted device blocks -> offload tier, read first
    offload_loads: list[BlockLoad] = field(
        default_factory=list
    )  # offload tier -> device, before the forward
    offload_writes: list[BlockSave] = field(default_factory=list)  # filled -> disk, after forward
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # admission raised

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.drafts) for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        proposer: NgramProposer | None = None,
        policy: str = "fcfs",
        adapter_keys: Mapping[str, str] | None = None,
        whole_prompts: bool = False,
    ) -> None:
        """adapter_keys: each LoRA adapter's name -> what keys its prefix blocks (its weights'
        fingerprint: a restart with other weights under the same name finds none of them).
        whole_prompts: a prompt runs in one step, never in chunks, nor after a cached prefix (an
        encoder's: every token attends to all of its prompt; max_num_batched_tokens must hold
        the longest)."""
        self.kv = kv
        self.whole_prompts = whole_prompts
        self.adapter_keys = adapter_keys if adapter_keys is not None else {}
        self.by_priority = policy == "priority"
        self.proposer = proposer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; its block hashes are computed here, once, and grow with it."""
        p = seq.params
        adapter = None if p.lora_name is None else self.adapter_keys[p.lora_name]
        seq.block_hashes = self.kv.block_hashes(seq.token_ids, salt=p.cache_salt, adapter=adapter)
        self._enqueue(self.waiting, seq, front=False)

    @staticmethod
    def _rank(seq: Sequence) -> tuple:
        """The priority policy's order: lower first."""
        return (seq.params.priority, seq.group.metrics.arrival_time, seq.seq_id)

    def _enqueue(self, queue: deque[Sequence], seq: Sequence, front: bool) -> None:
        """A new sequence joins at the back, a preempted one at the front; by the priority policy,
        each in its rank."""
        if self.by_priority:
            queue.insert(bisect.bisect_right(queue, self._rank(seq), key=self._rank), seq)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        out.offload_saves, out.offload_loads, out.offload_writes = self.kv.take_offload_plan()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if self.by_priority:  # the budget goes in rank order, so victims are the lowest ranked
            self.running.sort(key=self._rank)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.group.beam is not None:
                i, budget, stop = self._schedule_beams(i, out, budget)
                if stop:
                    return budget
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            drafts, copies = self._speculate(seq, n, budget)
            if copies is None:
                copies = self.kv.allocate_slots(seq.seq_id, seq.block_hashes, n)
            while copies is None:
                victim = self._victim(i)
                self._preempt_victim(victim, out)
                if victim is seq:
                    return budget
                copies = self.kv.allocate_slots(seq.seq_id, seq.block_hashes, n)
            out.copies.extend(copies)
            out.scheduled.append(ScheduledSeq(seq, n, drafts))
            budget -= n + len(drafts)
            i += 1
        return budget

    def _schedule_beams(self, i: int, out: SchedulerOutput, budget: int) -> tuple[int, int, bool]:
        """The beams of running[i]'s search, running[i:j]: all with every token they lack when
        all are running and fit the budget (they sample), else each beam being recomputed with
        all but its last. Returns (j, the budget left, whether it preempted the beams themselves:
        nothing after them gets scheduled, as for a sequence that preempts itself)."""
        group = self.running[i].group
        j = i
        while j < len(self.running) and self.running[j].group is group:
            j += 1
        beams = self.running[i:j]
        lacking = [b.num_uncomputed_tokens for b in beams]
        together = len(beams) == len(group.live) and sum(lacking) <= budget
        planned: list[tuple[Sequence, int, list]] = []
        for beam, n in zip(beams, lacking):
            n = n if together else min(n - 1, budget)  # (apart, a decoding beam waits)
            if n <= 0:
                continue
            copies = self.kv.allocate_slots(beam.seq_id, beam.block_hashes, n)
            while copies is None:
                if len(self.running) == j:  # none after them: the beams give way
                    self._preempt_beams(group, out, recompute=bool(planned))
                    return i, budget, True
                self._preempt_victim(self._victim(j), out)
                copies = self.kv.allocate_slots(beam.seq_id, beam.block_hashes, n)
            planned.append((beam, n, copies))
            budget -= n
        for beam, n, copies in planned:
            out.copies.extend(copies)
            out.scheduled.append(ScheduledSeq(beam, n))
        return j, budget, False

    def _preempt_victim(self, victim: Sequence, out: SchedulerOutput) -> None:
        """Preempt a running sequence not yet scheduled this step, with its beams if it is one
        (they sit after it or around it, none scheduled yet either)."""
        if victim.group.beam is not None:
            self._preempt_beams(victim.group, out)
        else:
            self.running.remove(victim)
            self._preempt(victim, out)

    def _preempt_beams(
        self, group: SequenceGroup, out: SchedulerOutput, recompute: bool = False
    ) -> None:
        """All the running beams of one search, last first (so the queues keep their order).
        `recompute`: some were given slots this step (their copy-on-write copies never made):
        swapping those out would copy unwritten blocks, so every one is recomputed instead."""
        for beam in reversed([s for s in self.running if s.group is group]):
            self.running.remove(beam)
            self._preempt(beam, out, recompute)

    @staticmethod
    def _held_back(seq: Sequence) -> int:
        """1 for a beam coming back (swapped in, or admitted to be recomputed) beside others:
        its last token waits for theirs (_schedule_beams), so that all sample together."""
        return int(seq.group.beam is not None and len(seq.group.live) > 1)

    def _place(self, seq: Sequence) -> None:
        """Into `running`: after the beams of its search already there, else last."""
        if seq.group.beam is not None:
            at = [k for k, s in enumerate(self.running) if s.group is seq.group]
            if at:
                self.running.insert(at[-1] + 1, seq)
                return
        self.running.append(seq)

    def _victim(self, i: int) -> Sequence:
        """Whom to preempt for running[i]: the latest admitted (by the priority policy, the last
        in rank) of running[i:], those not scheduled yet this step (by the priority policy, the
        last in rank of all)."""
        return max(self.running[i:], key=self._rank) if self.by_priority else self.running[-1]

    def _speculate(self, seq: Sequence, n: int, budget: int) -> tuple[list[int], list | None]:
        """Drafts for a decoding sequence and the slots for them, or ([], None) to schedule it
        plainly."""
        if self.proposer is None or n != 1 or seq.num_uncomputed_tokens != 1:
            return [], None
        if not self.proposer.config.drafts_for_batch(len(self.running)):
            return [], None
        room = min(
            seq.group.max_tokens - seq.num_output_tokens - 1,
            budget - 1,
            (self.kv.max_model_len or len(seq.token_ids)) - len(seq.token_ids),
        )
        drafts = self.proposer.propose(seq.token_ids, room)
        if not drafts:
            return [], None
        copies = self.kv.allocate_slots(seq.seq_id, seq.block_hashes, 1, num_lookahead=len(drafts))
        return (drafts, copies) if copies is not None else ([], None)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            plan = self.kv.swap_in(seq.seq_id)
            if plan is None:
                break
            self.swapped.popleft()
            out.swap_in.extend(plan)
            seq.status = Status.RUNNING
            self._place(seq)
            n = min(seq.num_uncomputed_tokens - self._held_back(seq), budget)
            copies = self.kv.allocate_slots(seq.seq_id, seq.block_hashes, n) if n > 0 else None
            if copies is not None:  # else it waits in running for the next step
                out.copies.extend(copies)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bs = self.kv.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            every_position = seq.params.every_prompt_position or self.whole_prompts
            try:  # reads the offload tiers: a failure there is this request's, not the engine's
                prefix = NO_PREFIX if every_position else self.kv.lookup_prefix(seq.block_hashes)
                n = len(seq.token_ids) - prefix.num_blocks * bs - self._held_back(seq)
                if self.whole_prompts and n > budget:
                    break  # (it runs first in the next step)
                n = min(n, budget)
                remaining = seq.group.max_tokens - seq.num_output_tokens
                copies = self.kv.allocate_slots(
                    seq.seq_id, seq.block_hashes, n, prefix=prefix, max_tokens=remaining
                )
            except Exception as e:  # noqa: BLE001 - the engine fails the request, still at the head
                out.failed.append((seq, e))
                break
            if copies is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            out.copies.extend(copies)
            computed = self.kv.num_cached_tokens(
                seq.seq_id
            )  # less than planned if a tier block failed its check
            seq.num_computed_tokens = computed
            seq.status = Status.RUNNING
            self._place(seq)
            group = seq.group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = computed
            if n > 0:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput, recompute: bool = False) -> None:
        self.num_preemptions += 1
        out.preempted.append(seq)
        swap = self.preemption_mode == "swap" and not recompute
        if swap and self.kv.can_swap_out(seq.seq_id):
            plan = self.kv.swap_out(seq.seq_id)
            if plan is not None:
                out.swap_out.extend(plan)
                seq.status = Status.SWAPPED
                # victims leave latest-first, so this keeps admission order
                self._enqueue(self.swapped, seq, front=True)
                return
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self._enqueue(self.waiting, seq, front=True)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out wherever it is and return its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
        if self.kv.has_request(seq.seq_id):
            self.kv.free(seq.seq_id)
        seq.status = Status.FINISHED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start sample `child` from `parent` after its prefill: it shares every block,
        copy-on-write, and the parent's block hashes so far."""
        child.block_hashes = parent.block_hashes.copy()
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = Status.RUNNING
        self._place(child)

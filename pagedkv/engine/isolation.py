"""Keep one request's failure inside that request: the forward pass of a step, retried in parts.

A step runs every scheduled sequence in one forward. If it raises, the batch is
halved and each half run again, halving the halves that still fail, until the
sequences that fail alone are found; their requests fail, every other sequence
gets exactly its own rows. That is sound because nothing has advanced yet
(`num_computed_tokens` moves only after the step's forward succeeded) and a
rerun writes the same K/V slots with the same values.

One dependency needs care: the prefix cache registers a block when it is
allocated, so a request admitted this step can hit blocks another sequence only
computes in this same forward. If that sequence fails, those blocks were never
(or half) written: a sequence resting on them is rewound to recompute them
itself, and when the failed request is freed, its unwritten blocks leave the
cache (`KVCacheManager.uncache_uncomputed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.scheduler import ScheduledSeq
from pagedkv.engine.sequence import SequenceGroup

log = logging.getLogger("pagedkv")

FaultCheck = Callable[[str, Iterable[SequenceGroup]], None]


@dataclass
class Failures:
    """The requests failed in this step, with the cause, and the blocks left unwritten."""

    errors: dict[SequenceGroup, BaseException] = field(default_factory=dict)
    stale_blocks: set[int] = field(default_factory=set)

    def add(self, group: SequenceGroup, error: BaseException) -> None:
        self.errors.setdefault(group, error)

    def __contains__(self, group: SequenceGroup) -> bool:
        return group in self.errors


def device_broken(error: BaseException) -> bool:
    """A CUDA error poisons the context, a lost tensor-parallel rank the group (`fatal`):
    no retry can work, the engine must restart."""
    return isinstance(error, torch.AcceleratorError) or getattr(error, "fatal", False)


@dataclass
class IsolatedForward:
    runner: ModelRunner
    check_faults: FaultCheck | None = None

    def __call__(
        self, scheduled: list[ScheduledSeq], failures: Failures
    ) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        """The sequences that sample and their logits rows, in batch order. Those that failed are
        left out, but not a sibling sample of theirs that ran before they failed."""
        try:
            return self._run(scheduled)
        except Exception as e:  # noqa: BLE001 - found and charged to its request below
            if device_broken(e):
                raise
            log.warning(
                "a forward of %d sequences failed (%s: %s); running it in parts",
                len(scheduled),
                type(e).__name__,
                e,
            )
        done: list[tuple[list[ScheduledSeq], torch.Tensor | None]] = []
        self._halve(scheduled, scheduled, failures, done)
        seqs = [seq for part, _ in done for seq in part]
        logits = [rows for _, rows in done if rows is not None]
        return seqs, torch.cat(logits) if logits else None

    def _run(self, part: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor | None]:
        sampling = [s for s in part if s.samples]
        if self.check_faults is not None:
            self.check_faults("forward", (s.seq.group for s in part))
        logits = self.runner.forward(part)
        if self.check_faults is not None:
            self.check_faults("after-forward", (s.seq.group for s in part))
        return sampling, logits

    def _halve(
        self,
        part: list[ScheduledSeq],
        scheduled: list[ScheduledSeq],
        failures: Failures,
        done: list[tuple[list[ScheduledSeq], torch.Tensor | None]],
    ) -> None:
        """`part` failed as a whole: run each half (in order, so a block's writer runs before its
        readers), halving again a half that fails; a sequence that fails alone fails its request."""
        mid = len(part) // 2
        for half in (part[:mid], part[mid:]):
            half = [s for s in half if s.seq.group not in failures]  # a sibling sample failed
            if not half:
                continue
            self._rewind(half, failures.stale_blocks)
            try:
                done.append(self._run(half))
                continue
            except Exception as e:  # noqa: BLE001
                if device_broken(e):
                    raise
                error = e
            if len(half) > 1:
                self._halve(half, scheduled, failures, done)
            else:
                group = half[0].seq.group
                failures.add(group, error)
                failures.stale_blocks.update(self._written_by(group, scheduled))

    def _written_by(self, group: SequenceGroup, scheduled: list[ScheduledSeq]) -> set[int]:
        """The blocks this step writes for the request's sequences."""
        bs, kv, blocks = self.runner.block_size, self.runner.kv, set[int]()
        assert kv is not None  # the engine's runner (rank 0) holds it
        for s in scheduled:
            if s.seq.group is group:
                start = s.seq.num_computed_tokens
                table = kv.block_table(s.seq.seq_id)
                blocks.update(table[start // bs : (start + s.num_new_tokens - 1) // bs + 1])
        return blocks

    def _rewind(self, part: list[ScheduledSeq], stale: set[int]) -> None:
        """A sequence whose computed prefix includes a block a failed request left unwritten
        recomputes from that block on (same tokens at the same positions: the same K/V)."""
        if not stale:
            return
        bs, kv = self.runner.block_size, self.runner.kv
        assert kv is not None
        for s in part:
            start = s.seq.num_computed_tokens
            table = kv.block_table(s.seq.seq_id)
            for i in range(-(-start // bs)):
                if table[i] in stale:
                    s.num_new_tokens += start - i * bs
                    s.seq.num_computed_tokens = i * bs
                    break

"""One request in flight, and the sequences (samples) it forks into.

The scheduler schedules sequences, not requests: with n > 1 the request is
prefilled once as sample 0, then forked so all samples share the prompt's
blocks (copy-on-write), and each sample can be preempted on its own. A beam
search's sequences are its live beams (engine/beam_search.py): they fork and end
at every step, and run together.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

from pagedkv.engine import pooling
from pagedkv.engine.beam_search import BeamState
from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprob
from pagedkv.engine.request import SamplingParams
from pagedkv.kv.hashing import BlockHashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    index: int  # sample index within its request
    group: SequenceGroup
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    rng: random.Random  # per sample: a seed draws the same alone or in a batch (see sampler.py)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    text: str = ""  # detokenized output
    prefix_offset: int = 0  # incremental detokenizer state (see detokenizer.py)
    read_offset: int = 0
    logprobs: list[SampleLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cum_logprob: float = 0.0  # a beam's, over its output tokens
    # chained hashes of the full blocks, extended in append_token (the scheduler sets them up)
    block_hashes: BlockHashes = field(default_factory=lambda: BlockHashes(None))

    def append_token(self, token: int) -> None:
        """A sampled (or verified draft) token joins the sequence; a block it fills is hashed."""
        self.token_ids.append(token)
        self.block_hashes.update(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def num_uncomputed_tokens(self) -> int:
        """1 while decoding; more while the prompt (or, after a recompute, prompt + outputs) is
        prefilled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    """A request: its prompt, parameters, samples and timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against max_model_len
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(
        default_factory=lambda: RequestMetrics(arrival_time=time.monotonic())
    )
    num_cached_tokens: int = 0
    aborted: bool = False
    prompt_logprobs: list[SampleLogprob] = field(
        default_factory=list
    )  # prompt tokens 1.. (if asked)
    beam: BeamState | None = None  # a beam search's finished beams and steps
    pooled: pooling.Pooled | None = None  # an embedding request's pooling so far

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
    ) -> SequenceGroup:
        group = cls(request_id, prompt, list(prompt_token_ids), params, max_tokens)
        group.seqs.append(group.new_seq(0, list(prompt_token_ids)))
        if params.use_beam_search:
            group.beam = BeamState()
        if params.pooling is not None:
            group.pooled = pooling.Pooled(params.pooling)
        return group

    def new_seq(self, index: int, token_ids: list[int]) -> Sequence:
        seed = self.params.seed
        # unseeded: drawn from the engine's seeded generator (--seed), as vLLM does
        rng = random.Random(random.getrandbits(64) if seed is None else f"{seed}:{index}")
        return Sequence(
            f"{self.request_id}#{index}",
            index,
            self,
            token_ids,
            len(self.prompt_token_ids),
            rng,
            logprobs=[] if self.params.logprobs is not None else None,
        )

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done or self.aborted
        forked = (
            len(self.seqs) == self.params.n or self.aborted
        )  # an abort before the fork ends it too
        return forked and all(s.finished for s in self.seqs)

    def to_output(self, text_of) -> RequestOutput:
        """`text_of(seq)` gives the text to show (stop-string prefixes held back while running)."""
        outs = (
            self.beam.outputs
            if self.beam is not None and self.beam.done
            else [
                CompletionOutput(
                    s.index,
                    text_of(s),
                    list(s.output_token_ids),
                    s.finish_reason,
                    list(s.logprobs) if s.logprobs is not None else None,
                    s.stop_reason,
                )
                for s in self.seqs
            ]
        )
        wants = self.params.prompt_logprobs is not None
        prompt_lps = [None, *self.prompt_logprobs] if wants else None
        pooled, num_prompt = None, len(self.prompt_token_ids)
        if self.pooled is not None and self.finished and self.pooled.upto == num_prompt:
            pooled = pooling.result(self.pooled, num_prompt)  # (not when aborted part way)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            self.finished,
            self.num_cached_tokens,
            self.metrics,
            prompt_logprobs=prompt_lps,
            pooled=pooled,
        )

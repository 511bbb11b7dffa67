"""Beam search (vLLM's `use_beam_search`, `LLM.beam_search`): n beams advanced in lockstep.

A beam-search request's sequences are its live beams. The scheduler runs them in the same step
(scheduler.py: a group samples only when all of it can), and after the forward the engine takes
each beam's 2n most likely next tokens (the model's logprobs, before temperature) as candidates.
Those ending in EOS are set aside as finished; the n best of the others are the next beams. A
parent with one chosen child carries it on; with more, the others fork from it and share its
blocks, copy-on-write (the partial last block is copied when each writes its token); a parent
with none ends and its blocks go back. After max_tokens steps, the n best of all beams, finished
or not, are the answer: one output, at the end.

A beam's score is its cumulative logprob over its length to the power length_penalty, the length
counting the prompt and not a final EOS (vLLM's `get_beam_search_score`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, SampleLogprob
from pagedkv.engine.request import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.sequence import Sequence


@dataclass
class Ended:
    """A beam that ended in EOS."""

    tokens: list[int]  # output tokens (the EOS only with include_stop_str_in_output)
    cum_logprob: float
    length: int  # prompt + output, the EOS not counted
    eos: int
    logprobs: list[SampleLogprob] | None  # when asked: one record a token


@dataclass
class Choice:
    """A next beam: `parent` followed by `token`."""

    parent: Sequence
    token: int
    cum_logprob: float
    record: SampleLogprob | None  # the token's logprob record, when asked


@dataclass
class Candidates:
    """A live beam's next tokens: its 2n most likely (token -> logprob, most likely first), and
    the alternatives its logprobs show (None: not asked)."""

    beam: Sequence
    top: dict[int, float]
    shown: dict[int, float] | None = None
    shift: float = 0.0  # added to a logprob to show it (the row's log-sum-exp: a logit)

    def record(self, token: int) -> SampleLogprob | None:
        if self.shown is None:
            return None
        value = self.top[token] + self.shift
        return SampleLogprob(token, value, self.shown, list(self.top).index(token) + 1)


@dataclass
class BeamState:
    """A beam-search request's ended beams and steps; its live beams are its group's unfinished
    sequences."""

    ended: list[Ended] = field(default_factory=list)
    steps: int = 0
    next_index: int = 1  # the next forked beam's sequence index
    done: bool = False
    outputs: list[CompletionOutput] = field(default_factory=list)  # the answer, when done


def score(cum_logprob: float, length: int, length_penalty: float) -> float:
    return cum_logprob / (length**length_penalty)


def choose(
    state: BeamState,
    params: SamplingParams,
    candidates: list[Candidates],
    eos_token_ids: set[int],
) -> list[Choice]:
    """The next beams from each live beam's candidates; candidates ending in EOS join
    state.ended."""
    live: list[tuple[float, Choice]] = []
    for c in candidates:
        seq, length = c.beam, len(c.beam.token_ids)
        for token, logprob in c.top.items():
            cum, record = seq.cum_logprob + logprob, c.record(token)
            if token in eos_token_ids and not params.ignore_eos:
                kept = list(seq.output_token_ids)
                if params.include_stop_str_in_output:
                    kept.append(token)
                logs = None if record is None else [*(seq.logprobs or ()), record]
                state.ended.append(Ended(kept, cum, length, token, logs))
            else:
                rank = score(cum, length + 1, params.length_penalty)
                live.append((rank, Choice(seq, token, cum, record)))
    live.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep the beams' order
    return [c for _, c in live[: params.n]]


def answer(state: BeamState, params: SamplingParams, live: list[Sequence], decode) -> None:
    """The n best of the ended and the live beams, as the request's outputs (`decode(token_ids)`
    gives a beam's text); the live ones end with "length"."""
    p = params
    beams = [
        (score(e.cum_logprob, e.length, p.length_penalty), e.tokens, e.cum_logprob, "stop", e.eos,
         e.logprobs)
        for e in state.ended
    ] + [
        (score(s.cum_logprob, len(s.token_ids), p.length_penalty), list(s.output_token_ids),
         s.cum_logprob, "length", None, s.logprobs)
        for s in live
    ]  # fmt: skip
    beams.sort(key=lambda b: b[0], reverse=True)
    state.outputs = [
        CompletionOutput(i, decode(tokens), tokens, reason, logs, eos, cum)
        for i, (_, tokens, cum, reason, eos, logs) in enumerate(beams[: p.n])
    ]
    state.done = True


@dataclass
class BeamSearchParams:
    """vLLM's, for `LLM.beam_search` (temperature is taken and, as there, ranks nothing)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            use_beam_search=True,
        )


@dataclass
class BeamSearchSequence:
    """vLLM's: `tokens` and `text` hold the prompt too."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]

    @classmethod
    def of(cls, out: RequestOutput, decode) -> BeamSearchOutput:
        def sequence(o: CompletionOutput) -> BeamSearchSequence:
            tokens = out.prompt_token_ids + o.token_ids
            cum = o.cumulative_logprob or 0.0
            return BeamSearchSequence(tokens, cum, decode(tokens), o.finish_reason, o.stop_reason)

        return cls([sequence(o) for o in out.outputs])

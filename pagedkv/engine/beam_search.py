"""Beam search (vLLM's `use_beam_search`, `LLM.beam_search`): n beams advanced in lockstep.

Each step asks the engine, for every live beam, one token with the 2n most likely next tokens and
their logprobs (the model's own, before temperature), as one batch of ordinary requests whose
prompts are the beams so far. Prefix caching gives every such request the full blocks its beam
shares with the prompt and with the beams it forked from, so a step computes at most a block's
worth of tokens a beam, and the blocks of a common stem are held once. Of the candidates, those
ending in EOS are set aside as finished; the n best of the others go on. After max_tokens steps,
the n best of all are the answer.

A beam's score is its cumulative logprob over its length to the power length_penalty, the length
counting the prompt and not a final EOS (vLLM's `get_beam_search_score`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedkv.engine.request import SamplingParams


@dataclass
class Beam:
    tokens: list[int]  # output tokens so far (a final EOS only with include_stop_str_in_output)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None
    length: int = 0  # prompt + output tokens, a final EOS not counted: the score's length


@dataclass
class BeamSearch:
    """One prompt's search. `pending()` gives the prompts of this step's requests (none: done),
    `advance()` takes each one's logprob record, `output()` the answer."""

    prompt_ids: list[int]
    params: SamplingParams  # n: the beam width
    max_tokens: int  # resolved against max_model_len
    eos_token_ids: set[int]
    beams: list[Beam] = field(default_factory=list)
    finished: list[Beam] = field(default_factory=list)
    steps: int = 0
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache at the first step
    metrics: RequestMetrics = field(
        default_factory=lambda: RequestMetrics(arrival_time=time.monotonic())
    )

    def __post_init__(self) -> None:
        self.beams = [Beam([], length=len(self.prompt_ids))]

    def step_params(self) -> SamplingParams:
        """One token, greedy, with the 2n most likely next tokens: what each beam asks a step."""
        p = self.params
        return dataclasses.replace(
            SamplingParams(),
            n=1,
            temperature=0.0,
            max_tokens=1,
            logprobs=2 * p.n,
            skip_special_tokens=p.skip_special_tokens,
            cache_salt=p.cache_salt,
            priority=p.priority,
            lora_name=p.lora_name,
        )

    def pending(self) -> list[list[int]]:
        if self.steps >= self.max_tokens:
            return []
        return [self.prompt_ids + b.tokens for b in self.beams]

    def score(self, beam: Beam) -> float:
        return beam.cum_logprob / (beam.length**self.params.length_penalty)

    def advance(self, outs: list[RequestOutput]) -> None:
        """outs[i]: the finished request of beam i (its logprobs' `top`: the 2n candidates)."""
        p = self.params
        if self.steps == 0:
            self.num_cached_tokens = outs[0].num_cached_tokens
            self.metrics.first_token_time = time.monotonic()
        live: list[Beam] = []
        for beam, out in zip(self.beams, outs, strict=True):
            records = out.outputs[0].sample_logprobs
            assert records, "a step asks logprobs"
            record = records[-1]
            for token, logprob in record.top.items():
                cum = beam.cum_logprob + logprob
                if token in self.eos_token_ids and not p.ignore_eos:
                    kept = [*beam.tokens, token] if p.include_stop_str_in_output else beam.tokens
                    self.finished.append(Beam(kept, cum, "stop", token, beam.length))
                else:
                    live.append(Beam([*beam.tokens, token], cum, length=beam.length + 1))
        live.sort(key=self.score, reverse=True)
        self.beams = live[: p.n]
        self.steps += 1

    def output(self, request_id: str, prompt: str | None, decode) -> RequestOutput:
        """The n best beams, finished or not (those cut by max_tokens end with "length");
        `decode(token_ids)` gives a beam's text."""
        best = sorted(self.finished + self.beams, key=self.score, reverse=True)[: self.params.n]
        outputs = [
            CompletionOutput(
                i,
                decode(b.tokens),
                b.tokens,
                b.finish_reason or "length",
                stop_reason=b.stop_reason,
                cumulative_logprob=b.cum_logprob,
            )
            for i, b in enumerate(best)
        ]
        self.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id, prompt, self.prompt_ids, outputs, True, self.num_cached_tokens, self.metrics
        )


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

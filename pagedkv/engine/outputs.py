"""What a request gets back: RequestOutput with its CompletionOutputs, logprobs and metrics.

Shaped like vLLM's classes of the same names (vllm/outputs.py) so code can move between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SampleLogprob:
    """The sampler's record for one token: its logprob and rank.

    The top alternatives come with it (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None  # 1 = the most likely token


@dataclass
class Logprob:
    """vLLM's per-token entry in CompletionOutput.logprobs.

    That is a dict token id -> Logprob per position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample, with vLLM's fields.

    `logprobs` is filled (decoded) where outputs leave the engine."""

    index: int
    text: str
    token_ids: list[int]
    # None while running; "stop" | "length" | "abort" | "repetition" (repetition_detection)
    finish_reason: str | None = None
    sample_logprobs: list[SampleLogprob] | None = (
        None  # the engine's records (the server reads these)
    )
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    cumulative_logprob: float | None = None  # set when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None = None

    def __post_init__(self) -> None:
        if self.sample_logprobs is not None and self.cumulative_logprob is None:
            self.cumulative_logprob = sum(lp.logprob for lp in self.sample_logprobs)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def decode_logprobs(self, decode) -> None:
        """Fill `logprobs` in vLLM's shape; `decode(token_id)` gives a token's text."""
        if self.sample_logprobs is None:
            return
        done = self.logprobs or []
        for lp in self.sample_logprobs[len(done) :]:
            ranked = {t: Logprob(v, r, decode(t)) for r, (t, v) in enumerate(lp.top.items(), 1)}
            if lp.token_id not in ranked:
                ranked[lp.token_id] = Logprob(lp.logprob, lp.rank, decode(lp.token_id))
            done.append(ranked)
        self.logprobs = done


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic()) for TTFT, inter-token latency and end-to-end."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    prompt_logprobs: list[SampleLogprob | None] | None = None  # the first prompt token has none
    # a pooling request's pooled hidden state (a row a prompt token for a per-token task), once
    # finished
    pooled: torch.Tensor | None = None  # float32

    def decode_logprobs(self, decode) -> RequestOutput:
        for o in self.outputs:
            o.decode_logprobs(decode)
        return self


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's result of LLM.embed for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's: one prompt's labels' probabilities (or logits, without use_activation)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's result of LLM.classify for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    """vLLM's: what a pooling task made of one prompt (LLM.encode): its embedding, or its labels'
    probabilities, as a float32 tensor."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """vLLM's result of LLM.encode and AsyncLLMEngine.encode for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's result of LLM.score for one pair (the tokens of the prompts it was scored from)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True

    @classmethod
    def of(cls, a: RequestOutput, b: RequestOutput, score: float) -> ScoringRequestOutput:
        """The pair scored from the prompts of a and b (a bi-encoder's two texts), or of a alone
        (a cross-encoder's, b being a)."""
        if a is b:
            return cls(a.request_id, a.prompt_token_ids, ScoringOutput(score))
        ids = a.prompt_token_ids + b.prompt_token_ids
        return cls(f"{a.request_id}_{b.request_id}", ids, ScoringOutput(score))

"""What a user asks for (SamplingParams) and what they get back (RequestOutput).

Shaped like vLLM's classes of the same names so code can move between the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.config import require


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16       # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None       # number of top alternatives to return per token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError (HTTP 400) with the name of the bad parameter."""
        need = require
        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0), f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens")
        need(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs must be in [0, 20]")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SampleLogprob:
    """The sampler's record for one token: its logprob and rank, with the top alternatives (id -> logprob)."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None                   # 1 = the most likely token


@dataclass
class Logprob:
    """vLLM's per-token entry in CompletionOutput.logprobs (a dict token id -> Logprob per position)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample, with vLLM's fields. `logprobs` is filled (decoded) where outputs leave the engine."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # None while running; "stop" | "length" | "abort"
    sample_logprobs: list[SampleLogprob] | None = None   # the engine's records (the server reads these)
    stop_reason: str | int | None = None      # the stop string or token id that ended it
    cumulative_logprob: float | None = None   # set when logprobs were asked for
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
        for lp in self.sample_logprobs[len(done):]:
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
    error: str | None = None          # why the engine failed this request (finish_reason "error")
    prompt_logprobs: None = None              # prompt logprobs are not computed here

    def decode_logprobs(self, decode) -> "RequestOutput":
        for o in self.outputs:
            o.decode_logprobs(decode)
        return self

"""What a user asks for (SamplingParams) and what they get back (RequestOutput).

Shaped like vLLM's classes of the same names so code can move between the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.config import require


@dataclass
class StructuredOutputsParams:
    """One output constraint (vLLM's class of the same name): exactly one of the fields is set.

    `grammar` is a Lark grammar as llguidance takes it (GBNF is converted); `json_object` means
    any JSON object.
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [k for k in kinds if getattr(self, k)]
        require(len(given) == 1, f"structured_outputs needs exactly one of {', '.join(kinds)}; "
                f"got {', '.join(given) or 'none'}")
        require(self.choice is None or (isinstance(self.choice, list) and self.choice
                                        and all(isinstance(c, str) for c in self.choice)),
                "structured_outputs.choice must be a non-empty list of strings")

    @property
    def key(self) -> str:
        """A stable identity for the grammar cache."""
        import json as _json
        return _json.dumps([self.json, self.regex, self.choice, self.grammar, self.json_object],
                           sort_keys=True)


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
    spaces_between_special_tokens: bool = True   # as vLLM with a fast tokenizer: no effect
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None       # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None       # only these may be drawn
    bad_words: list[str] | None = None               # never completed (vLLM's semantics)
    prompt_logprobs: int | None = None               # top alternatives per prompt token
    truncate_prompt_tokens: int | None = None        # keep the last N prompt tokens (-1: all fit)
    structured_outputs: StructuredOutputsParams | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)   # by the engine

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
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
        self._validate_token_fields()

    def _validate_token_fields(self) -> None:
        need = require
        need(all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()),
             "logit_bias values must be in [-100, 100]")
        need(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list)
                                                and len(self.allowed_token_ids) > 0),
             "allowed_token_ids must be a non-empty list of token ids")
        need(all(isinstance(w, str) and w.strip() for w in self.bad_words or []),
             "bad_words must be non-empty strings")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs must be in [0, 20]")
        need(self.truncate_prompt_tokens is None or (isinstance(self.truncate_prompt_tokens, int)
                                                     and (self.truncate_prompt_tokens >= 1
                                                          or self.truncate_prompt_tokens == -1)),
             f"truncate_prompt_tokens must be -1 or >= 1, got {self.truncate_prompt_tokens}")

    def truncate(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the model sees it: its last truncate_prompt_tokens tokens, if set."""
        n = self.truncate_prompt_tokens
        if n is None:
            return prompt_ids
        return prompt_ids[-(max_model_len if n == -1 else n):]

    def token_ids_used(self) -> list[int]:
        """Every token id the parameters name (checked against the vocabulary by the engine)."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Logprob:
    """Log probability of the chosen token, with the top alternatives (token id -> logprob)."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None            # of the chosen token (1 = most likely); prompt logprobs only


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None          # None while running; "stop" | "length" | "abort"
    logprobs: list[Logprob] | None = None
    stop_reason: str | int | None = None      # the stop string or token id that ended it


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
    prompt_logprobs: list[Logprob | None] | None = None   # the first prompt token has none

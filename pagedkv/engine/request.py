"""What a user asks for: SamplingParams and its limits (what they get back is in outputs.py).

Shaped like vLLM's class of the same name so code can move between the two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from pagedkv.config import ConfigError, is_digits

POOLING_TYPES = ("LAST", "MEAN", "CLS")  # how engine/pooling.py makes an embedding
EVERY_TOKEN = "ALL"  # every prompt token's own hidden state (vLLM's per-token pooling tasks)

# Limits on what one request may ask for; the server's request models reuse them.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what torch and numpy can hold: seeds, top_k, counts
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature means greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: lower ones (not greedy) are raised to it
MAX_TEMPERATURE = 2.0  # as OpenAI and vLLM
TOP_P_FLOOR = 1e-8  # smaller ones keep just the top token too, but float32 rounds them to 0
REPETITION_PENALTY_RANGE = (1e-6, 1e6)  # far past any use; beyond, float32 logits overflow
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256  # each step scans every stop string's prefixes against the text's tail
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_LIST = 4096  # logit_bias / allowed_token_ids entries
MAX_BAD_WORDS = 128
MAX_LENGTH_PENALTY = 100.0
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's cap on logprob_token_ids
# what shapes sampling, so cannot be combined with beam search (at their defaults they may be given)
BEAM_EXCLUDED = (
    "top_p", "top_k", "min_p", "seed", "min_tokens", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
    "bad_words", "prompt_logprobs", "structured_outputs", "thinking_token_budget",
    "logprob_token_ids", "repetition_detection",
)  # fmt: skip


class ParamError(ConfigError):
    """A bad request parameter (HTTP 400); `param` names it as the OpenAI error's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def rename(self, name: str) -> None:
        """Name the field as the request spelled it, in `param` and in a message that starts
        with `param=value` (chat's max_completion_tokens, a response's max_output_tokens)."""
        message = str(self)
        if name != self.param and message.startswith(f"{self.param}="):
            self.args = (name + message[len(self.param) :],)
        self.param = name


def valid_text(text: str) -> bool:
    """True unless `text` holds a lone surrogate (JSON "\\ud800"), which no tokenizer can encode."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(value: Any) -> str:
    """A bad value for an error message: short, never str() of a 5,000-digit int (that raises)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _need(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


def _check_int(param: str, value: Any, lo: int, hi: int = INT64_MAX) -> None:
    _need(type(value) is int, param, f"{param} must be an integer, got {shown(value)}")
    span = f">= {lo} and fit in 64 bits" if hi == INT64_MAX else f"in [{lo}, {hi}]"
    _need(lo <= value <= hi, param, f"{param} must be {span}, got {shown(value)}")


def _check_float(param: str, value: Any, lo: float, hi: float, above_lo: bool = False) -> None:
    """A finite number in [lo, hi], or in (lo, hi] with above_lo."""
    _need(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        param,
        f"{param} must be a number, got {shown(value)}",
    )
    _need(
        isinstance(value, int) or math.isfinite(value),
        param,
        f"{param} must be a finite number, got {value}",
    )
    _need(
        (lo < value if above_lo else lo <= value) and value <= hi,
        param,
        f"{param} must be in {'(' if above_lo else '['}{lo:g}, {hi:g}], got {shown(value)}",
    )


def _check_bool(param: str, value: Any) -> None:
    _need(isinstance(value, bool), param, f"{param} must be true or false, got {shown(value)}")


def _as_list(param: str, value: Any, one: type) -> list:
    """None, a single `one`, or a list/tuple of them -> a list (items are checked by the caller)."""
    if value is None:
        return []
    if isinstance(value, one):
        return [value]
    _need(
        isinstance(value, (list, tuple)),
        param,
        f"{param} must be a list, got {type(value).__name__}",
    )
    return list(value)


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's repetition_detection: an output ends (finish_reason "repetition") once its last
    N tokens, for an N from min_pattern_size (0: 1) to max_pattern_size (0: off), came min_count
    times in a row (checked once min_tokens are out, as vLLM)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def check(self) -> None:
        name = "repetition_detection"
        for field_name in ("max_pattern_size", "min_pattern_size", "min_count"):
            _check_int(f"{name}.{field_name}", getattr(self, field_name), 0)
        _need(
            self.min_pattern_size <= self.max_pattern_size,
            name,
            f"{name}: min_pattern_size must not exceed max_pattern_size (0 and 0: off)",
        )
        _need(
            self.max_pattern_size == 0 or self.min_count >= 2,
            name,
            f"{name}: min_count must be at least 2 (a pattern that repeats)",
        )

    def repeats(self, tokens: list[int]) -> bool:
        """Whether `tokens` end with a pattern repeated min_count times in a row."""
        end = len(tokens)
        for size in range(self.min_pattern_size or 1, self.max_pattern_size + 1):
            if size * self.min_count > end:
                return False
            tail = tokens[end - size :]
            if all(
                tokens[end - size * (m + 1) : end - size * m] == tail
                for m in range(1, self.min_count)
            ):
                return True
        return False


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
        given = [k for k in kinds if getattr(self, k) not in (None, False)]  # {} and "" are given
        _need(
            len(given) == 1,
            "structured_outputs",
            "structured_outputs needs exactly one of "
            f"{', '.join(kinds)}; got {', '.join(given) or 'none'}",
        )
        _need(
            self.choice is None
            or (
                isinstance(self.choice, list)
                and bool(self.choice)
                and all(isinstance(c, str) for c in self.choice)
            ),
            "structured_outputs",
            "structured_outputs.choice must be a non-empty list of strings",
        )

    @property
    def key(self) -> str:
        """A stable identity for the grammar cache."""
        import json as _json

        return _json.dumps(
            [self.json, self.regex, self.choice, self.grammar, self.json_object], sort_keys=True
        )


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: an adapter for `LLM.generate` / `LLM.chat`, loaded from its PEFT folder on first
    use (the id is vLLM's and only carried here: the name keys the adapter)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    seed: int | None = None  # -1 = None (random), as in vLLM
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top alternatives to return per token; -1: all (the engine caps)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # as vLLM with a fast tokenizer: no effect
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    bad_words: list[str] | None = None  # never completed (vLLM's semantics)
    prompt_logprobs: int | None = None  # top alternatives per prompt token; -1: all
    truncate_prompt_tokens: int | None = None  # keep N prompt tokens (-1: all that fit)
    # which of them (`truncate`): "left" cuts the start, "right" the end; None: a generation's
    # left, a pooling request's right (as vLLM 0.32)
    truncation_side: str | None = None
    # prefix-cache isolation: only requests with the same salt share cached blocks (vLLM takes it
    # with the prompt; the offline API also reads a prompt dict's "cache_salt")
    cache_salt: str | None = None
    priority: int = 0  # with --scheduling-policy priority: lower runs first (vLLM's request field)
    # the LoRA adapter the request runs under (the server: the request's model; LLM.generate:
    # its lora_request); None: the base model
    lora_name: str | None = None
    # streaming (vLLM's): outputs carry at least this many new tokens each, but the first and the
    # last, raising the engine's --stream-interval (None: as the engine says)
    stream_interval: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: a reasoning section that has run this many tokens is closed, its closing tokens
    # forced (engine/reasoning.py; needs a reasoning parser whose marks are tokens)
    thinking_token_budget: int | None = None
    # vLLM's: each output token's logprobs of these tokens (instead of the top `logprobs`)
    logprob_token_ids: list[int] | None = None
    repetition_detection: RepetitionDetection | None = None  # (a dict is taken too)
    # beam search (engine/beam_search.py): n beams, scored by cumulative logprob / length **
    # length_penalty; the fields of sampling (BEAM_EXCLUDED) cannot be combined with it
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # an embedding (engine/pooling.py): "LAST", "MEAN" or "CLS" pooling of the prompt's final
    # hidden states, or "ALL" of them, a row a token; the one token sampled after the prompt is
    # not shown
    pooling: str | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)  # by the engine

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = _repetition_detection(self.repetition_detection)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field, then normalise what means the same thing (idempotent).

        The one place for range rules: the server, `LLM` and the CLI all come
        here, so they reject exactly the same values. Raises ParamError (HTTP
        400) naming the parameter; with `vocab_size`, token ids are checked too.
        """
        self._check_numbers()
        self._check_stops(vocab_size)
        self._check_token_fields(vocab_size)
        for flag in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "use_beam_search",
        ):
            _check_bool(flag, getattr(self, flag))
        self._normalise()
        self._check_beam_search()
        self._check_pooling()

    @property
    def every_prompt_position(self) -> bool:
        """Whether the request needs every prompt position's hidden row (prompt logprobs, MEAN,
        CLS or ALL pooling), so skips the prefix cache: a cached block's positions are never
        computed."""
        return self.prompt_logprobs is not None or self.pooling in ("MEAN", "CLS", EVERY_TOKEN)

    def _check_pooling(self) -> None:
        if self.pooling is None:
            return
        if self.pooling not in (*POOLING_TYPES, EVERY_TOKEN):
            kinds = ", ".join((*POOLING_TYPES, EVERY_TOKEN))
            raise ParamError("pooling", f"pooling must be one of {kinds}")
        if self.n != 1 or self.use_beam_search:
            raise ParamError("pooling", "a prompt is pooled once: n 1, no beams")

    def _check_beam_search(self) -> None:
        """Beam search ranks candidates by the model's logprobs alone: what would shape them
        otherwise is an error, not ignored (temperature does not change which beams win)."""
        _check_float("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        if not self.use_beam_search:
            _need(
                self.length_penalty == 1.0,
                "length_penalty",
                "length_penalty applies to beam search only (use_beam_search)",
            )
            return
        default = _default_params()
        for name in BEAM_EXCLUDED:
            _need(
                getattr(self, name) == getattr(default, name),
                name,
                f"{name} cannot be combined with use_beam_search",
            )

    def _check_numbers(self) -> None:
        _check_int("n", self.n, 1)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, above_lo=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, 0)
        _need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary (as vLLM)
            if getattr(self, name) is not None:  # the engine's --max-logprobs caps them
                _check_int(name, getattr(self, name), -1)
        _check_int("priority", self.priority, INT64_MIN)
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, 1)
        _need(
            self.lora_name is None or (isinstance(self.lora_name, str) and self.lora_name != ""),
            "lora_name",
            "lora_name must be a non-empty string",
        )
        _need(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
            "cache_salt",
            "cache_salt must be a non-empty string",
        )
        _need(
            self.truncation_side in (None, "left", "right"),
            "truncation_side",
            "truncation_side must be left or right",
        )
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            _need(
                self.truncate_prompt_tokens != 0,
                "truncate_prompt_tokens",
                "truncate_prompt_tokens must be -1 (all that fit) or >= 1",
            )

    def _check_stops(self, vocab_size: int | None) -> None:
        self.stop = _as_list("stop", self.stop, str)
        _need(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"stop takes at most {MAX_STOP_STRINGS} strings",
        )
        for s in self.stop:
            _need(isinstance(s, str) and s != "", "stop", "stop must be non-empty strings")
            _need(
                len(s) <= MAX_STOP_CHARS,
                "stop",
                f"each stop string must be at most {MAX_STOP_CHARS} characters",
            )
            _need(valid_text(s), "stop", "stop must be valid Unicode (it holds a lone surrogate)")
        ids = _as_list("stop_token_ids", self.stop_token_ids, int)
        _need(
            len(ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids",
        )
        top = INT64_MAX if vocab_size is None else vocab_size - 1
        for t in ids:
            _need(
                type(t) is int and 0 <= t <= top,
                "stop_token_ids",
                f"stop token id {shown(t)} is outside the vocabulary [0, {top + 1})"
                if vocab_size
                else f"stop_token_ids must be integers >= 0, got {shown(t)}",
            )
        ids = list(dict.fromkeys(ids))  # deduplicated, as vLLM does
        self.stop_token_ids = ids

    def _check_token_fields(self, vocab_size: int | None) -> None:
        """logit_bias, allowed_token_ids, bad_words: token ids in the vocabulary, bounded sizes."""
        top = INT64_MAX if vocab_size is None else vocab_size - 1

        def token_id(param: str, t: Any) -> int:
            if isinstance(t, str) and is_digits(t) and len(t) <= 19:  # JSON keys are strings
                t = int(t)
            _need(
                type(t) is int and 0 <= t <= top,
                param,
                f"{param}: token id {shown(t)} is outside the vocabulary [0, {top + 1})"
                if vocab_size
                else f"{param}: token ids must be integers >= 0, got {shown(t)}",
            )
            return t

        if self.logit_bias is not None:
            _need(isinstance(self.logit_bias, dict), "logit_bias", "logit_bias must be an object")
            _need(
                len(self.logit_bias) <= MAX_TOKEN_LIST,
                "logit_bias",
                f"logit_bias takes at most {MAX_TOKEN_LIST} tokens",
            )
            bias = {}
            for t, v in self.logit_bias.items():
                _check_float("logit_bias", v, -100.0, 100.0)
                bias[token_id("logit_bias", t)] = float(v)
            self.logit_bias = bias or None

        def token_list(param: str, most: int) -> list[int]:
            ids = _as_list(param, getattr(self, param), int)
            _need(0 < len(ids) <= most, param, f"{param} must hold 1 to {most} token ids")
            return [token_id(param, t) for t in ids]

        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_list("allowed_token_ids", MAX_TOKEN_LIST)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = token_list("logprob_token_ids", MAX_LOGPROB_TOKEN_IDS)
            if self.logprobs is None:  # (their logprobs are this token's alternatives)
                self.logprobs = 0
        if self.repetition_detection is not None:
            _need(
                isinstance(self.repetition_detection, RepetitionDetection),
                "repetition_detection",
                "repetition_detection must be an object",
            )
            self.repetition_detection.check()
        words = _as_list("bad_words", self.bad_words, str)
        _need(
            len(words) <= MAX_BAD_WORDS,
            "bad_words",
            f"bad_words takes at most {MAX_BAD_WORDS} words",
        )
        for w in words:
            _need(
                isinstance(w, str) and w.strip() != "" and len(w) <= MAX_STOP_CHARS,
                "bad_words",
                f"bad_words must be non-empty strings of at most {MAX_STOP_CHARS} characters",
            )
            _need(
                valid_text(w),
                "bad_words",
                "bad_words must be valid Unicode (it holds a lone surrogate)",
            )
        self.bad_words = words or None

    def truncate(
        self, prompt_ids: list[int], max_model_len: int, specials: tuple[int, int] = (0, 0)
    ) -> list[int]:
        """The prompt as the model sees it: with truncate_prompt_tokens N, N of its tokens, cut
        at truncation_side's end. `specials`: how many tokens at its start and at its end the
        tokenizer added ([CLS] and [SEP], a BOS): they stay, as a tokenizer's own truncation
        keeps them (a prompt of token ids has none)."""
        n = self.truncate_prompt_tokens
        if n is None:
            return prompt_ids
        n = max_model_len if n == -1 else n
        if len(prompt_ids) <= n:
            return prompt_ids
        lead, trail = specials if sum(specials) < n else (0, 0)
        body = prompt_ids[lead : len(prompt_ids) - trail]
        keep = n - lead - trail
        right = (self.truncation_side or ("left" if self.pooling is None else "right")) == "right"
        body = body[:keep] if right else body[len(body) - keep :]
        return prompt_ids[:lead] + body + prompt_ids[len(prompt_ids) - trail :]

    def _normalise(self) -> None:
        """vLLM's meanings: seed -1 is no seed, top_k 0 is off, a tiny temperature is greedy."""
        if self.seed == -1:
            self.seed = None
        if self.top_k == 0:
            self.top_k = -1
        if self.temperature < GREEDY_BELOW:
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, -1, 0.0
        elif self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.top_p = max(self.top_p, TOP_P_FLOOR)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _repetition_detection(value: dict) -> RepetitionDetection:
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(RepetitionDetection)})
    _need(not unknown, "repetition_detection", f"repetition_detection: unknown field {unknown}")
    return RepetitionDetection(**value)


@functools.cache
def _default_params() -> SamplingParams:
    return SamplingParams()

"""n-gram speculative decoding: drafts from the sequence's own tokens, verified in the same forward.

The proposer looks for the longest suffix of the sequence (prompt_lookup_max
down to prompt_lookup_min tokens) that occurred before, and proposes the tokens
that followed its latest earlier occurrence. The scheduler gives a decoding
sequence 1 + k rows (its last token and k drafts); their logits come back
together. Verification samples each row in turn with the sequence's own
parameters and random stream, exactly as plain decoding would, and keeps going
while the sampled token equals the draft. For a draft that is one fixed token
this is rejection sampling (accept with probability p(draft), else draw from p
without it), so the output distribution is the target's, and a greedy or seeded
request gives the same tokens with or without speculation.

Drafting pays while a step is bound by reading the weights: the extra rows ride
along for free. In a large batch the step is bound by arithmetic and rejected
drafts cost real time, so, like vLLM's ``disable_by_batch_size``, no sequence
drafts in a step with more running sequences than that. ``auto`` (the default)
is ngram with the settings below, measured on W1-W3 (BENCHMARKS.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pagedkv.config import ConfigError

MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
OFF = ("off", "none", "null", "")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    disable_by_batch_size: int | None = None  # no drafts in a step with more running sequences
    auto: bool = False  # the default, not the user's choice (quantized KV turns it off)

    def drafts_for_batch(self, num_running: int) -> bool:
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """vLLM's --speculative-config: a JSON object (or a dict from Python); None turns it off."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().lower() in OFF:
            return None
        if isinstance(value, str) and value.strip().lower() == "auto":
            return AUTO
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        unknown = set(value) - {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        }
        if unknown:
            raise ConfigError(f"--speculative-config: unsupported keys {sorted(unknown)}")
        if value.get("method", "ngram") != "ngram":
            raise ConfigError(
                f"--speculative-config: method {value.get('method')!r} is not supported "
                "(only ngram)"
            )
        k = _positive_int("num_speculative_tokens", value.get("num_speculative_tokens"))
        lookup = {
            name: _positive_int(name, value[name])
            for name in ("prompt_lookup_max", "prompt_lookup_min")
            if value.get(name) is not None
        }  # vLLM's defaults: a bound left out is the other one; both left out, 5
        hi = lookup.get("prompt_lookup_max", lookup.get("prompt_lookup_min", DEFAULT_LOOKUP))
        lo = lookup.get("prompt_lookup_min", hi)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"--speculative-config: num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}"
            )
        if lo > hi:
            raise ConfigError(
                "--speculative-config: prompt_lookup_min must be <= prompt_lookup_max"
            )
        cap = value.get("disable_by_batch_size")
        cap = None if cap is None else _positive_int("disable_by_batch_size", cap)
        return cls(k, hi, lo, disable_by_batch_size=cap)


# measured on W1-W3 (BENCHMARKS.md, "speculation by default")
AUTO = SpeculativeConfig(4, 4, 2, disable_by_batch_size=32, auto=True)


def _positive_int(name: str, v: object) -> int:
    if type(v) is not int or v < 1:
        raise ConfigError(f"--speculative-config: {name} must be a positive integer, got {v!r}")
    return v


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) tokens: those that followed the latest earlier match of the
        longest suffix."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        n_tokens = len(tokens)
        for n in range(
            min(self.config.prompt_lookup_max, n_tokens - 1), self.config.prompt_lookup_min - 1, -1
        ):
            windows = np.lib.stride_tricks.sliding_window_view(
                tokens[:-1], n
            )  # every start before the suffix
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


@dataclass
class SpecDecodeStats:
    """vLLM's counters: steps that drafted, tokens drafted, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

"""Test-only fault injection: make chosen requests fail at one stage of an engine step.

That one request's failure ends that request alone can only be tested by making a
request fail on purpose, in a real engine and a real server process. Set
`PAGEDKV_INJECT_FAULT=STAGE:MARKER[:AFTER]` in the server's environment (or assign
`LLMEngine.faults` in-process) and every request whose prompt contains MARKER
raises `InjectedFault` at STAGE, once it has AFTER output tokens (default 0):

- forward: before the model runs over a batch holding the request (no K/V written)
- after-forward: after it ran (the batch's K/V are written)
- sample: in the sampler, for any batch holding the request
- detokenize: when the request's new token is detokenized
- step: at the start of a step while the request is in the engine; this one is not
  isolated (it stands for a bug in the engine itself), so it stops the engine loop

Unset (the default), the engine pays one `is None` test per stage.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.config import ConfigError, is_digits
from pagedkv.engine.sequence import SequenceGroup

if TYPE_CHECKING:
    from pagedkv.model.tokenizer import Tokenizer

ENV = "PAGEDKV_INJECT_FAULT"
STAGES = ("forward", "after-forward", "sample", "detokenize", "step")


class InjectedFault(RuntimeError):
    """Raised on purpose by FaultInjector."""


@dataclass
class FaultInjector:
    stage: str
    marker: str
    tokenizer: Tokenizer
    after: int = 0  # output tokens the request makes before it fails
    _matches: dict[str, bool] = field(default_factory=dict)  # request id -> has the marker

    def __post_init__(self) -> None:
        if self.stage not in STAGES or not self.marker:
            raise ConfigError(f"{ENV} must be STAGE:MARKER with STAGE one of {', '.join(STAGES)}")

    @classmethod
    def from_env(cls, tokenizer: Tokenizer) -> FaultInjector | None:
        spec = os.environ.get(ENV)
        if not spec:
            return None
        stage, _, marker = spec.partition(":")
        marker, _, after = marker.partition(":")
        if after and not is_digits(after):
            raise ConfigError(f"{ENV}: AFTER must be a number of tokens, got {after!r}")
        return cls(stage, marker, tokenizer, int(after or 0))

    def check(self, stage: str, groups: Iterable[SequenceGroup]) -> None:
        """Raise if `stage` is the chosen one and one of `groups` is a chosen request."""
        if stage != self.stage:
            return
        for group in groups:
            if self._chosen(group) and group.seqs[0].num_output_tokens >= self.after:
                raise InjectedFault(f"injected {stage} fault for request {group.request_id}")

    def _chosen(self, group: SequenceGroup) -> bool:
        hit = self._matches.get(group.request_id)
        if hit is None:
            prompt = group.prompt
            if prompt is None:
                prompt = self.tokenizer.decode(group.prompt_token_ids)
            hit = self._matches[group.request_id] = self.marker in prompt
        return hit

"""--enable-log-requests and --enable-log-outputs: each request's arrival and answer in the
server's log, in vLLM's words (its RequestLogger), so that log searches written for vLLM work.

INFO carries the request id and its parameters, and with --enable-log-outputs each answer's
text and finish reason (a streamed answer's pieces too, unless --no-enable-log-deltas); DEBUG
(--log-level DEBUG, or PAGEDKV_LOGGING_LEVEL=DEBUG) adds the prompt, its token ids and the
answer's. --max-log-len cuts each text to that many characters and each id list to that many
ids. Logger: `pagedkv.requests`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.request import SamplingParams

log = logging.getLogger("pagedkv.requests")
_DEFAULTS = SamplingParams()
Logged = TypeVar("Logged", str, Sequence[int])


def given(params: SamplingParams) -> str:
    """The parameters a request set (those that differ from the defaults), for one log line."""
    fields = (
        f"{f.name}={getattr(params, f.name)!r}"
        for f in dataclasses.fields(params)
        if f.repr and getattr(params, f.name) != getattr(_DEFAULTS, f.name)
    )
    return f"SamplingParams({', '.join(fields)})"


@dataclass(frozen=True, slots=True)
class RequestLog:
    outputs: bool = False  # --enable-log-outputs
    deltas: bool = True  # --enable-log-deltas: a streamed answer's pieces too (with outputs)
    max_len: int | None = None  # --max-log-len

    def _cut(self, value: Logged) -> Logged:
        return value if self.max_len is None else value[: self.max_len]

    def received(
        self,
        request_id: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        decode: Callable[[list[int]], str],
    ) -> None:
        """A request the engine took; a prompt given as token ids is decoded for DEBUG only."""
        if log.isEnabledFor(logging.DEBUG):
            text = prompt if prompt is not None else decode(list(self._cut(token_ids)))
            log.debug(
                "Request %s details: prompt: %r, prompt_token_ids: %s.",
                request_id,
                self._cut(text),
                list(self._cut(token_ids)),
            )
        log.info(
            "Received request %s: params: %s, lora_request: %s.",
            request_id,
            given(params),
            params.lora_name,
        )

    def answers(self, streaming: bool) -> AnswerLog | None:
        """What logs one request's answers as its outputs come (None: they are not logged)."""
        return AnswerLog(self, streaming) if self.outputs else None

    def generated(
        self, request_id: str, output: CompletionOutput, text: str, streaming: bool, delta: bool
    ) -> None:
        """One choice's answer (`text`: all of it, or a streamed piece when `delta`)."""
        how = (" (streaming delta)" if delta else " (streaming complete)") if streaming else ""
        choice = f"{request_id}[{output.index}]" if output.index else request_id
        if log.isEnabledFor(logging.DEBUG) and not delta:
            log.debug(
                "Generated response %s%s details: output_token_ids: %s",
                choice,
                how,
                list(self._cut(output.token_ids)),
            )
        log.info(
            "Generated response %s%s: output: %r, finish_reason: %s",
            choice,
            how,
            self._cut(text),
            output.finish_reason,
        )


@dataclass(slots=True)
class AnswerLog:
    """One request's answers: each choice whole once it ends and, streaming, each new piece."""

    log: RequestLog
    streaming: bool
    said: dict[int, int] = dataclasses.field(default_factory=dict)  # characters logged, by choice
    ended: set[int] = dataclasses.field(default_factory=set)

    def __call__(self, out: RequestOutput) -> None:
        for o in out.outputs:
            start = self.said.get(o.index, 0)
            if self.streaming and self.log.deltas and len(o.text) > start:
                self.log.generated(out.request_id, o, o.text[start:], True, True)
                self.said[o.index] = len(o.text)
            if o.finish_reason is not None and o.index not in self.ended:
                self.log.generated(out.request_id, o, o.text, self.streaming, False)
                self.ended.add(o.index)

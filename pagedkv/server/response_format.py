"""What the two generation endpoints share in their response bodies: the format interface,
token text for logprobs, choice numbering, usage, and vLLM's prompt_logprobs shape."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, SampleLogprob
from pagedkv.server import responses as api
from pagedkv.server.streaming import KEEP_ALIVE, sse

MIN_LOGPROB = -9999.0  # JSON has no -inf


def token_decoder(tokenizer, as_ids: bool = False) -> Callable[[int], str]:
    """One token's text for logprobs; special tokens (an end-of-turn, say) are shown, not dropped.

    With `as_ids` (return_tokens_as_token_ids) it is "token_id:N", as vLLM writes it."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def prompt_logprobs_json(
    token: Callable[[int], str], items: list[SampleLogprob | None] | None
) -> list | None:
    """vLLM's shape: per prompt token, None (the first) or {id: {logprob, rank, decoded_token}}."""
    if items is None:
        return None

    def entry(value: float, rank: int | None, token_id: int) -> dict:
        return {"logprob": max(value, MIN_LOGPROB), "rank": rank, "decoded_token": token(token_id)}

    out: list[dict | None] = [None]
    for lp in items[1:]:
        assert lp is not None  # only the first prompt token has no logprob
        top = {t: entry(v, r, t) for r, (t, v) in enumerate(lp.top.items(), 1)}
        top[lp.token_id] = entry(lp.logprob, lp.rank, lp.token_id)
        out.append(top)
    return out


def numbered_choices(finals: list[RequestOutput], n: int) -> list[tuple[int, CompletionOutput]]:
    """OpenAI numbers choices across a batch: prompt i, sample j -> index i * n + j."""
    return [(i * n + c.index, c) for i, o in enumerate(finals) for c in o.outputs]


def usage_of(finals: list[RequestOutput]) -> api.Usage:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=api.PromptTokensDetails(cached_tokens=cached),
    )


@dataclass(frozen=True)
class Delta:
    """What choice `index` produced since its last stream chunk."""

    index: int
    text: str  # the new text; it starts at character `offset` of the output
    logprobs: list[SampleLogprob] | None  # the new tokens' logprobs, when asked for
    offset: int
    output: CompletionOutput  # the whole output so far
    finished: bool
    token_ids: list[int] = field(default_factory=list)  # the new tokens
    prompt_token_ids: list[int] = field(default_factory=list)
    first: bool = False  # the choice's first chunk


@dataclass
class ResponseFormat(ABC):
    """Turns engine outputs into one endpoint's response objects (completions or chat)."""

    id: str
    model: str
    token: Callable[[int], str]
    created: int = field(default_factory=lambda: int(time.time()))
    token_ids: bool = False  # return_token_ids: the prompt's and the output's ids too
    done_marker: ClassVar[str | None] = "data: [DONE]\n\n"  # a stream's last line

    def ids(self, token_ids: list[int]) -> list[int] | None:
        """`token_ids` where the request asked for them, else None (left out of the body)."""
        return list(token_ids) if self.token_ids else None

    def start(self, num_choices: int, first: RequestOutput) -> list[BaseModel]:
        """Chunks sent before any token (chat announces the assistant role); `first` is the first
        output of the stream."""
        return []

    def waiting(self) -> list[str]:
        """What a stream sends when it starts before its first output (--sse-keep-alive-interval,
        or a background Response's): a keep-alive comment."""
        return [KEEP_ALIVE]

    def shown(self, out: RequestOutput) -> RequestOutput:
        """What the client gets of an engine output: all of it, but for a scored prompt."""
        return out

    @abstractmethod
    def chunk(self, d: Delta) -> BaseModel | None:
        """One stream chunk for `d`, or None when it holds nothing to send yet."""

    @abstractmethod
    def response(self, finals: list[RequestOutput]) -> BaseModel:
        """The whole non-streamed answer, from each prompt's final output."""

    @abstractmethod
    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        """The last stream chunk when stream_options.include_usage is set."""

    def closing(self, finals: list[RequestOutput], include_usage: bool) -> list[BaseModel]:
        """What a stream sends after every choice's last chunk."""
        return [self.usage_chunk(usage_of(finals))] if include_usage else []

    def frame(self, payload: BaseModel) -> str:
        """One stream chunk (or error body) as server-sent events."""
        return sse(payload)

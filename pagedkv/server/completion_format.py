"""/v1/completions bodies: choices with text, echo, and the legacy logprobs shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

from pydantic import BaseModel

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, SampleLogprob
from pagedkv.server import responses as api
from pagedkv.server.response_format import (
    MIN_LOGPROB,
    Delta,
    ResponseFormat,
    numbered_choices,
    prompt_logprobs_json,
    usage_of,
)


@dataclass
class CompletionFormat(ResponseFormat):
    echo: list[str] | None = None  # per prompt: the text shown before its choices' output
    n: int = 1
    echo_only: bool = False  # max_tokens 0: the prompt is scored; its one sampled token is hidden

    def shown(self, out: RequestOutput) -> RequestOutput:
        if not self.echo_only:
            return out
        hidden = [
            replace(
                o,
                text="",
                token_ids=[],
                sample_logprobs=None if o.sample_logprobs is None else [],
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="length" if o.finished() else None,
                stop_reason=None,
            )
            for o in out.outputs
        ]
        return replace(out, outputs=hidden)

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def start(self, num_choices: int, first: RequestOutput) -> list[BaseModel]:
        if not self.echo:
            return []
        return [
            api.CompletionResponse(
                id=self.id,
                model=self.model,
                created=self.created,
                choices=[api.CompletionChoice(index=i, text=self._echo(i))],
            )
            for i in range(num_choices)
        ]

    def logprobs(
        self, items: Sequence[SampleLogprob | int] | None, offset: int
    ) -> api.CompletionLogprobs | None:
        """A bare token id is the first prompt token under echo: nothing precedes it to score it."""
        if items is None:
            return None
        out = api.CompletionLogprobs()
        for lp in items:
            text = self.token(lp if isinstance(lp, int) else lp.token_id)
            out.tokens.append(text)
            if isinstance(lp, int):
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
                top = {self.token(t): max(v, MIN_LOGPROB) for t, v in lp.top.items()}
                out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _choice(self, i: int, o: CompletionOutput, prompt: RequestOutput) -> api.CompletionChoice:
        items: Sequence[SampleLogprob | int] | None = o.sample_logprobs
        if self.echo and items is not None:
            # echo with logprobs: the prompt's tokens come first; only its first token has none
            scored = cast(list[SampleLogprob], prompt.prompt_logprobs)[1:]
            items = [prompt.prompt_token_ids[0], *scored, *items]
        return api.CompletionChoice(
            index=i,
            text=self._echo(i) + o.text,
            logprobs=self.logprobs(items, 0),
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            prompt_logprobs=prompt_logprobs_json(self.token, prompt.prompt_logprobs),
            token_ids=self.ids(o.token_ids),
            prompt_token_ids=self.ids(prompt.prompt_token_ids),
        )

    def chunk(self, d: Delta) -> BaseModel:
        o = d.output
        return api.CompletionResponse(
            id=self.id,
            model=self.model,
            created=self.created,
            choices=[
                api.CompletionChoice(
                    index=d.index,
                    text=d.text,
                    logprobs=self.logprobs(d.logprobs, d.offset),
                    finish_reason=o.finish_reason if d.finished else None,
                    stop_reason=o.stop_reason if d.finished else None,
                    token_ids=self.ids(d.token_ids),
                    prompt_token_ids=self.ids(d.prompt_token_ids) if d.first else None,
                )
            ],
        )

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        return api.CompletionResponse(
            id=self.id,
            model=self.model,
            created=self.created,
            usage=usage_of(finals),
            choices=[
                self._choice(i, o, finals[i // self.n]) for i, o in numbered_choices(finals, self.n)
            ],
        )

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        return api.CompletionResponse(
            id=self.id, model=self.model, created=self.created, choices=[], usage=usage
        )

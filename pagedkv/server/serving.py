"""Completions and chat completions: run a request on the engine, answer in JSON or SSE.

Both endpoints share one path: prompts -> token ids -> engine.validate (400
before any work) -> one engine stream per prompt, merged -> a JSON body or an
event stream. The first engine output is awaited before the response starts,
so a full queue is still a 429 and not an error inside a 200 stream. A client
that goes away cancels the work, and closing the engine's iterator aborts the
request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagedkv.config import ConfigError
from pagedkv.engine.options import with_defaults
from pagedkv.engine.request import (
    CompletionOutput,
    RequestOutput,
    SampleLogprob,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedkv.server import protocol as api
from pagedkv.server.errors import APIError, error_body, to_api_error
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.tool_parsers import HermesToolParser, ToolCallStream, final_tool_calls
from pagedkv.server.tools import plan_tools, render_chat

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; cancel it if the client disconnects.

    Cancelling it aborts its engine requests."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as (index, item); closing the merge closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as s:
                async for item in s:
                    queue.put_nowait((i, item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EventStream(StreamingResponse):
    """SSE response that always closes its iterator.

    However the stream ends, disconnects included."""

    def __init__(self, content: AsyncGenerator[str, None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._content = content  # the body_iterator itself, typed as the generator it is

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenize off the event loop: a megabyte of prompt takes most of a second."""
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


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


def request_id(prefix: str, given: str | None) -> str:
    return f"{prefix}-{given if given else uuid.uuid4().hex}"


def all_final(finals: list[RequestOutput | None]) -> list[RequestOutput]:
    """Each request's final output: every stream ends with one (or raises)."""
    done = [out for out in finals if out is not None]
    assert len(done) == len(finals)
    return done


def check_not_aborted(finals: list[RequestOutput]) -> None:
    """Only a shutdown aborts a request whose client is still there: tell the client so."""
    if any(c.finish_reason == "abort" for o in finals for c in o.outputs):
        raise APIError(503, "the server is shutting down; the request was aborted")


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


@dataclass
class _Sent:
    """What one choice has already streamed."""

    chars: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass
class _Format(ABC):
    """Turns engine outputs into one endpoint's response objects (completions or chat)."""

    id: str
    model: str
    token: Callable[[int], str]
    created: int = field(default_factory=lambda: int(time.time()))

    def start(self, num_choices: int) -> list[BaseModel]:
        """Chunks sent before any token (chat announces the assistant role)."""
        return []

    @abstractmethod
    def chunk(
        self,
        index: int,
        text: str,
        logprobs: list[SampleLogprob] | None,
        offset: int,
        o: CompletionOutput,
        finished: bool,
    ) -> BaseModel | None:
        """One stream chunk: choice `index` grew by `text` (which starts at character `offset`)."""

    @abstractmethod
    def response(
        self,
        choices: list[tuple[int, CompletionOutput]],
        usage: api.Usage,
        finals: list[RequestOutput],
    ) -> BaseModel:
        """The whole non-streamed answer."""

    @abstractmethod
    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        """The last stream chunk when stream_options.include_usage is set."""


@dataclass
class _CompletionFormat(_Format):
    echo: list[str] | None = None  # per prompt: the text shown before its choices' output
    n: int = 1

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def start(self, num_choices: int) -> list[BaseModel]:
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
        if self.echo and items is not None:  # echo with logprobs: the prompt's tokens come first
            # echo with logprobs asks for the prompt's; only its first token has none
            scored = cast(list[SampleLogprob], prompt.prompt_logprobs)[1:]
            items = [prompt.prompt_token_ids[0], *scored, *items]
        return api.CompletionChoice(
            index=i,
            text=self._echo(i) + o.text,
            logprobs=self.logprobs(items, 0),
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            prompt_logprobs=prompt_logprobs_json(self.token, prompt.prompt_logprobs),
        )

    def chunk(
        self,
        index: int,
        text: str,
        logprobs: list[SampleLogprob] | None,
        offset: int,
        o: CompletionOutput,
        finished: bool,
    ) -> BaseModel:
        return api.CompletionResponse(
            id=self.id,
            model=self.model,
            created=self.created,
            choices=[
                api.CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=self.logprobs(logprobs, offset),
                    finish_reason=o.finish_reason if finished else None,
                    stop_reason=o.stop_reason if finished else None,
                )
            ],
        )

    def response(
        self,
        choices: list[tuple[int, CompletionOutput]],
        usage: api.Usage,
        finals: list[RequestOutput],
    ) -> BaseModel:
        return api.CompletionResponse(
            id=self.id,
            model=self.model,
            created=self.created,
            usage=usage,
            choices=[self._choice(i, o, finals[i // self.n]) for i, o in choices],
        )

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        return api.CompletionResponse(
            id=self.id, model=self.model, created=self.created, choices=[], usage=usage
        )


@dataclass
class _ChatFormat(_Format):
    parser: HermesToolParser | None = None  # tool calls are read from the output
    echo: str = ""  # the last message, when the client asked to echo it
    streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def logprobs(self, items: list[SampleLogprob] | None) -> api.ChatLogprobs | None:
        if items is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {
                "token": text,
                "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(text.encode()),
            }

        return api.ChatLogprobs(
            content=[
                api.ChatTokenLogprob(
                    **entry(lp.token_id, lp.logprob),
                    top_logprobs=[api.TopLogprob(**entry(t, v)) for t, v in lp.top.items()],
                )
                for lp in items
            ]
        )

    def _chunk(
        self, choices: list[api.ChatChunkChoice], usage: api.Usage | None = None
    ) -> BaseModel:
        return api.ChatCompletionChunk(
            id=self.id, model=self.model, created=self.created, choices=choices, usage=usage
        )

    def start(self, num_choices: int) -> list[BaseModel]:
        delta = api.ChatDelta(role="assistant", content=self.echo)
        return [
            self._chunk([api.ChatChunkChoice(index=i, delta=delta)]) for i in range(num_choices)
        ]

    def chunk(
        self,
        index: int,
        text: str,
        logprobs: list[SampleLogprob] | None,
        offset: int,
        o: CompletionOutput,
        finished: bool,
    ) -> BaseModel | None:
        calls = None
        finish = o.finish_reason if finished else None
        if self.parser is not None:
            stream = self.streams.setdefault(index, ToolCallStream(self.parser))
            text, calls = stream.update(o.text, finished)
            if stream.calls and finish == "stop":
                finish = "tool_calls"
            if not (text or calls or logprobs or finished):
                return None  # nothing the client can use yet (a tool call still being written)
        return self._chunk(
            [
                api.ChatChunkChoice(
                    index=index,
                    delta=api.ChatDelta(content=text or None, tool_calls=calls or None),
                    logprobs=self.logprobs(logprobs),
                    finish_reason=finish,
                )
            ]
        )

    def message(self, o: CompletionOutput) -> tuple[api.ChatResponseMessage, str | None]:
        """The answer's message and finish reason: tool calls, when the output has them."""
        if self.parser is not None:
            parsed = self.parser.parse(o.text, final=True)
            calls = final_tool_calls(parsed)
            if calls:
                content = self.echo + parsed.content
                finish = "tool_calls" if o.finish_reason == "stop" else o.finish_reason
                message = api.ChatResponseMessage(
                    content=content if content.strip() else None, tool_calls=calls
                )
                return message, finish
        return api.ChatResponseMessage(content=self.echo + o.text), o.finish_reason

    def response(
        self,
        choices: list[tuple[int, CompletionOutput]],
        usage: api.Usage,
        finals: list[RequestOutput],
    ) -> BaseModel:
        out = []
        for i, o in choices:
            message, finish = self.message(o)
            out.append(
                api.ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self.logprobs(o.sample_logprobs),
                    finish_reason=finish,
                    stop_reason=o.stop_reason,
                )
            )
        prompt_lps = prompt_logprobs_json(self.token, finals[0].prompt_logprobs)
        return api.ChatCompletionResponse(
            id=self.id,
            model=self.model,
            created=self.created,
            usage=usage,
            choices=out,
            prompt_logprobs=prompt_lps,
        )

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        return self._chunk([], usage)


class OpenAIServing:
    """The two generation endpoints over one AsyncLLM."""

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.engine.config.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.engine.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def model_defaults(
        self, req: api.CompletionRequest | api.ChatCompletionRequest, params: SamplingParams
    ) -> SamplingParams:
        """--generation-config: the model's sampling defaults for what the request left out."""
        given = set(req.model_fields_set)
        if "max_completion_tokens" in given or isinstance(
            req, api.CompletionRequest
        ):  # completions: 16
            given.add("max_tokens")
        defaults = self.engine.engine.generation_defaults
        return with_defaults(params, defaults, set(defaults) - given)

    async def completions(self, req: api.CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        params = self.model_defaults(req, req.sampling_params())
        tok = self.engine.tokenizer
        special = req.add_special_tokens
        encoded = [
            p if isinstance(p, list) else await encode(tok, p, add_special_tokens=special)
            for p in req.prompt
        ]
        prompts = [params.truncate(ids, self.engine.max_model_len) for ids in encoded]
        echo = None
        if req.echo:  # the prompt as given, unless truncation cut it
            echo = [
                p
                if isinstance(p, str) and len(ids) == len(full)
                else tok.decode(ids, skip_special_tokens=False)
                for p, full, ids in zip(req.prompt, encoded, prompts)
            ]
        fmt = _CompletionFormat(
            request_id("cmpl", req.request_id),
            self.engine.model_name,
            token_decoder(tok, req.return_tokens_as_token_ids),
            echo=echo,
            n=params.n,
        )
        return await self._run(request, fmt, prompts, params, req.stream, req.include_usage)

    async def chat(self, req: api.ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        params = self.model_defaults(req, req.sampling_params())
        plan = plan_tools(req, self.engine.config.enable_auto_tool_choice)
        if plan.grammar is not None:
            if params.structured_outputs is not None:
                raise ConfigError(
                    "tool_choice required or a named function cannot be combined "
                    "with response_format or structured outputs"
                )
            params.structured_outputs = StructuredOutputsParams(grammar=plan.grammar)
        tok = self.engine.tokenizer
        text = render_chat(tok, req)
        prompt = await encode(tok, text, add_special_tokens=req.add_special_tokens)
        prompt = params.truncate(prompt, self.engine.max_model_len)
        last = req.messages[-1]
        echo = (last.content or "") if req.echo and last.role == "assistant" else ""
        fmt = _ChatFormat(
            request_id("chatcmpl", req.request_id),
            self.engine.model_name,
            token_decoder(tok, req.return_tokens_as_token_ids),
            parser=plan.parser,
            echo=echo,
        )
        return await self._run(request, fmt, [prompt], params, req.stream, req.include_usage)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Off the event loop and the engine thread; a grammar that does not compile: 400 here."""
        spec = params.structured_outputs
        if spec is not None:
            await asyncio.to_thread(self.engine.engine.structured.compile, spec)

    async def _run(
        self,
        request: Request,
        fmt: _Format,
        prompts: list[list[int]],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        await self._compile_grammar(params)
        for ids in prompts:
            self.engine.validate(ids, params)
        events = merge(
            [
                self.engine.generate(ids, params, request_id=f"{fmt.id}-{i}")
                for i, ids in enumerate(prompts)
            ]
        )
        try:
            if not stream:
                finals = await until_disconnect(request, self._collect(events, len(prompts)))
                check_not_aborted(finals)
                answer = fmt.response(numbered_choices(finals, params.n), usage_of(finals), finals)
                body = answer.model_dump_json()
                return Response(body, media_type="application/json")
            first = await until_disconnect(request, anext(events))
        except BaseException as e:
            await events.aclose()
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        return EventStream(self._stream(fmt, first, events, len(prompts), params.n, include_usage))

    async def _collect(
        self, events: AsyncGenerator[tuple[int, RequestOutput], None], num: int
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * num
        async with aclosing(events):
            async for i, out in events:
                if out.finished:
                    finals[i] = out
                    self.metrics.observe(out)
        return all_final(finals)

    async def _stream(
        self,
        fmt: _Format,
        first: tuple[int, RequestOutput],
        events: AsyncGenerator[tuple[int, RequestOutput], None],
        num: int,
        n: int,
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        finals: list[RequestOutput | None] = [None] * num
        sent: dict[int, _Sent] = {}
        try:
            async with aclosing(events):
                for start in fmt.start(num * n):
                    yield sse(start)
                item: tuple[int, RequestOutput] | None = first
                while item is not None:
                    i, out = item
                    for o in out.outputs:
                        chunk = self._delta(fmt, i * n + o.index, o, sent)
                        if chunk is not None:
                            yield sse(chunk)
                    if out.finished:
                        finals[i] = out
                        self.metrics.observe(out)
                    item = await anext(events, None)
            done = all_final(finals)
            check_not_aborted(done)
            if include_usage:
                yield sse(fmt.usage_chunk(usage_of(done)))
        except Exception as e:  # noqa: BLE001 - the status is already sent: report in the stream
            err = to_api_error(e)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        yield "data: [DONE]\n\n"

    @staticmethod
    def _delta(
        fmt: _Format, index: int, o: CompletionOutput, sent: dict[int, _Sent]
    ) -> BaseModel | None:
        """The chunk for what choice `index` has produced since the last one, if anything."""
        s = sent.setdefault(index, _Sent())
        if s.finished:
            return None
        text = o.text[s.chars :]
        logprobs = o.sample_logprobs[s.logprobs :] if o.sample_logprobs is not None else None
        finished = o.finish_reason is not None
        if not (text or logprobs or finished):
            return None
        chunk = fmt.chunk(index, text, logprobs, s.chars, o, finished)
        s.chars, s.finished = len(o.text), finished
        s.logprobs += len(logprobs or ())
        return chunk

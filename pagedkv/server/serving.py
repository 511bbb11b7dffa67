"""Completions and chat completions: run a request on the engine, answer in JSON or SSE.

Both endpoints share one path: prompts -> token ids -> engine.validate (400
before any work) -> one engine stream per prompt, merged -> a JSON body or an
event stream. The first engine output is awaited before the response starts,
so a full queue is still a 429 and not an error inside a 200 stream. A client
that goes away cancels the work, and closing the engine's iterator aborts the
request, which frees its blocks.

Each endpoint's bodies are built by its format (completion_format.py,
chat_format.py); disconnects, merging and SSE live in streaming.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from pagedkv.engine.async_engine import RequestFailedError
from pagedkv.engine.chat import content_text
from pagedkv.engine.options import with_defaults
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.request import (
    BEAM_EXCLUDED,
    ParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedkv.server import protocol as api
from pagedkv.server.chat_format import ChatFormat
from pagedkv.server.completion_format import CompletionFormat
from pagedkv.server.errors import APIError, error_body, to_api_error
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.middleware import REQUEST_ID_HEADER
from pagedkv.server.response_format import Delta, ResponseFormat, token_decoder
from pagedkv.server.response_store import EventLog, ResponseStore, StoredResponse, conversation
from pagedkv.server.responses_format import ResponsesFormat
from pagedkv.server.responses_protocol import ResponsesRequest, input_items
from pagedkv.server.streaming import ClientGone, EventStream, merge, sse, until_disconnect
from pagedkv.server.tools import chat_prompt, plan_tools


async def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Tokenize off the event loop: a megabyte of prompt takes most of a second."""
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)


def request_id(prefix: str, request: Request, given: str | None) -> str:
    """The answer's id: as vLLM, the X-Request-Id header's value, else the body's request_id, else
    a new one."""
    given = request.headers.get(REQUEST_ID_HEADER) or given
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


@dataclass
class _Sent:
    """What one choice has already streamed."""

    chars: int = 0
    logprobs: int = 0
    tokens: int = 0  # sent in chunks (a chunk held back, as a tool call being written, sends none)
    chunks: int = 0
    finished: bool = False


class OpenAIServing:
    """The two generation endpoints over one AsyncLLM."""

    def __init__(self, engine, metrics: ServerMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        kept = engine.config.max_stored_responses
        self.stored = ResponseStore(kept) if kept else None
        self.background: dict[str, asyncio.Task] = {}  # background responses running, by id

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's model names (None: the base model); 404 for a model
        this server does not serve."""
        if name is None or name in self.engine.config.served_model_names:
            return None
        if name in self.engine.engine.loras:
            return name
        raise self.unknown_model(name)

    def unknown_model(self, name: str) -> APIError:
        """The 404 for a model this server does not serve."""
        return APIError(
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
        # chat's max_completion_tokens is its max_tokens; a completion's max_tokens defaults to
        # OpenAI's 16, never to the model's
        if "max_completion_tokens" in given or isinstance(req, api.CompletionRequest):
            given.add("max_tokens")
        defaults = self.engine.engine.generation_defaults
        if params.use_beam_search:  # (the model's sampling defaults do not shape beams)
            given |= set(BEAM_EXCLUDED)
        return with_defaults(params, defaults, set(defaults) - given)

    async def completions(self, req: api.CompletionRequest, request: Request) -> Response:
        lora = self.check_model(req.model)
        params = self.model_defaults(req, req.sampling_params())
        params.lora_name = lora
        tok = self.engine.tokenizer
        special = req.add_special_tokens
        encoded = [
            p if isinstance(p, list) else await encode(tok, p, add_special_tokens=special)
            for p in req.prompt
        ]
        ends = tok.special_ends(special)  # (what encoding a text adds)
        prompts = [
            params.truncate(ids, self.engine.max_model_len, (0, 0) if p is ids else ends)
            for p, ids in zip(req.prompt, encoded)
        ]
        echo = None
        if req.echo:  # the prompt as given, unless truncation cut it
            echo = [
                p
                if isinstance(p, str) and len(ids) == len(full)
                else tok.decode(ids, skip_special_tokens=False)
                for p, full, ids in zip(req.prompt, encoded, prompts)
            ]
        fmt = CompletionFormat(
            request_id("cmpl", request, req.request_id),
            lora or self.engine.model_name,
            token_decoder(tok, self.as_token_ids(req)),
            token_ids=bool(req.return_token_ids),
            echo=echo,
            n=params.n,
            echo_only=req.echo_only,
        )
        return await self._run(request, req, fmt, prompts, params)

    async def chat(
        self,
        req: api.ChatCompletionRequest,
        request: Request,
        answer_id: str | None = None,
        form: type[ChatFormat] = ChatFormat,
        **form_fields,
    ) -> Response:
        """A chat completion; `form` and its fields shape the answer (/v1/responses: a Response,
        whose id is `answer_id`)."""
        lora = self.check_model(req.model)
        params = self.model_defaults(req, req.sampling_params())
        params.lora_name = lora
        plan = plan_tools(req, self.engine.config)
        tags = self.engine.engine.reasoning
        keeps = plan.parser is not None and plan.parser.keeps_special_tokens
        if keeps or (tags is not None and tags.special):
            params.skip_special_tokens = False  # a mark is a special token (as vLLM's mistral)
        if plan.grammar is not None:
            if params.structured_outputs is not None:
                raise ParamError(
                    "tool_choice",
                    "tool_choice required or a named function cannot be combined "
                    "with response_format or structured outputs",
                )
            params.structured_outputs = StructuredOutputsParams(grammar=plan.grammar)
        tok = self.engine.tokenizer
        text = chat_prompt(tok, req, self.engine.config, plan.parser)
        prompt = await encode(tok, text, add_special_tokens=req.add_special_tokens)
        ends = tok.special_ends(req.add_special_tokens)
        prompt = params.truncate(prompt, self.engine.max_model_len, ends)
        # as vLLM: the answer goes on the last message when no generation prompt opens a new one,
        # and echo repeats the last message when the answer is in its role
        last = req.messages[-1]
        role = self.engine.config.response_role if req.add_generation_prompt else last.role
        echo = content_text(last.content) or "" if req.echo and last.role == role else ""
        fmt = form(
            answer_id or request_id("chatcmpl", request, req.request_id),
            lora or self.engine.model_name,
            token_decoder(tok, self.as_token_ids(req)),
            token_ids=bool(req.return_token_ids),
            parser=plan.parser,
            role=role,
            echo=echo,
            thinking=tags.split_for(prompt) if tags else None,
            include_reasoning=req.include_reasoning,
            prompt_text=text if req.return_prompt_text else None,
            **form_fields,
        )
        return await self._run(request, req, fmt, [prompt], params)

    async def responses(self, req: ResponsesRequest, request: Request) -> Response:
        """/v1/responses: the request's chat turn, answered as a Response (responses_format.py),
        after the conversation it continues (previous_response_id); kept unless store is false."""
        store = self.response_store(req)
        chain = self.continued(req)
        try:
            chat = req.chat_request({}, conversation(chain))
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        given = request.headers.get(REQUEST_ID_HEADER) or chat.request_id
        answer_id = f"resp_{given or uuid.uuid4().hex}"
        if store is not None and any(s.body["id"] == answer_id for s in chain):
            raise ParamError(  # (kept, it would continue itself)
                "request_id",
                f"the answer's id {answer_id!r} is that of a response it continues: "
                "send another request id",
            )
        tools, tool_choice = req.reported_tools()
        settings = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,  # (None: the model's default, else 1)
            "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tools": tools,
            "tool_choice": tool_choice,
            "metadata": req.metadata or {},
            "user": req.user,
            "text": {"format": req.text_format()},
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning and {"effort": req.reasoning.effort, "summary": None},
        }
        tok = self.engine.tokenizer
        keep = None
        log = EventLog() if req.background and req.stream else None  # (kept: background is)
        if store is not None:
            own = input_items(req, answer_id)
            previous = req.previous_response_id
            keep = lambda body: store.put(StoredResponse(body, own, previous, log))  # noqa: E731
        return await self.chat(
            chat,
            request,
            answer_id=answer_id,
            form=ResponsesFormat,
            settings=settings,
            count_tokens=lambda text: len(tok.encode(text, add_special_tokens=False)),
            keep=keep,
            background=req.background,
            events=log,
        )

    def response_store(self, req: ResponsesRequest) -> ResponseStore | None:
        """Where the answer is kept (None: not kept); asking a server that keeps none to store
        or continue one is a 400."""
        if self.stored is None and (
            req.store or req.background or req.previous_response_id is not None
        ):
            field, send = (
                ("store", "store: false")
                if req.store
                else ("background", "no background")
                if req.background
                else ("previous_response_id", "the whole conversation as input")
            )
            raise ParamError(
                field,
                f"this server keeps no responses (--max-stored-responses 0): send {send}",
            )
        if req.background and req.store is False:
            raise ParamError(
                "background",
                "a background response must be stored, its answer retrieved later: send "
                "store: true, or none",
            )
        return None if req.store is False else self.stored

    def continued(self, req: ResponsesRequest) -> list[StoredResponse]:
        """The stored responses that previous_response_id continues, oldest first."""
        if req.previous_response_id is None:
            return []
        assert self.stored is not None  # (response_store refuses the id without one)
        chain = self.stored.chain(req.previous_response_id)
        if isinstance(chain, str):
            turn = "" if chain == req.previous_response_id else f"its earlier turn {chain!r} "
            raise ParamError(
                "previous_response_id",
                f"no stored response {req.previous_response_id!r}: {turn}is not kept "
                f"(this server keeps the latest {self.stored.capacity})",
            )
        if chain[-1].body["status"] in ("queued", "in_progress"):
            raise ParamError(
                "previous_response_id",
                f"response {req.previous_response_id!r} is still running in the background: "
                "continue it once it is done",
            )
        return chain

    def stored_response(self, response_id: str) -> StoredResponse:
        """A kept response, or the 404 OpenAI answers for one it does not have."""
        found = self.stored.get(response_id) if self.stored is not None else None
        if found is None:
            kept = f"the latest {self.stored.capacity}" if self.stored else "none"
            raise APIError(
                404,
                f"no stored response {response_id!r} (this server keeps {kept})",
                param="response_id",
                code="not_found",
            )
        return found

    def as_token_ids(self, req) -> bool:
        """return_tokens_as_token_ids: the request's, else --return-tokens-as-token-ids."""
        given = req.return_tokens_as_token_ids
        return self.engine.config.return_tokens_as_token_ids if given is None else given

    def usage_chunk(self, req) -> bool:
        """Whether a stream ends with usage: asked for, or --enable-force-include-usage."""
        forced = bool(req.stream) and self.engine.config.enable_force_include_usage
        return req.include_usage or forced

    async def _shown(
        self, fmt: ResponseFormat, outputs: AsyncGenerator[RequestOutput, None], streaming: bool
    ) -> AsyncGenerator[RequestOutput, None]:
        """What the client gets of one engine request, counted once in /metrics: at its final
        output, as an abort if its stream is closed or cancelled before (the client went away),
        as an error if it failed in the engine. One refused at the door (a full queue, a bad
        field) is not counted. With --enable-log-outputs it is logged as it goes."""
        finished = False
        logs = self.engine.request_log
        log_answer = logs.answers(streaming) if logs is not None else None
        try:
            async with aclosing(outputs) as each:
                async for out in each:
                    out = fmt.shown(out)
                    if log_answer is not None:
                        log_answer(out)
                    if out.finished:
                        finished = True
                        self.metrics.observe(out)
                    yield out
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                self.metrics.ended_early("abort")
            raise
        except RequestFailedError:
            self.metrics.ended_early("error")
            raise

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Off the event loop and the engine thread; a grammar that does not compile: 400 here."""
        spec = params.structured_outputs
        if spec is not None:
            await asyncio.to_thread(self.engine.engine.structured.compile, spec)

    async def _run(
        self,
        request: Request,
        req: api.CompletionRequest | api.ChatCompletionRequest,
        fmt: ResponseFormat,
        prompts: list[list[int]],
        params: SamplingParams,
    ) -> Response:
        await self._compile_grammar(params)
        try:
            for ids in prompts:
                self.engine.validate(ids, params)
        except ParamError as e:  # name the field as this request spelled it
            e.rename(req.wire_param(e.param))
            raise
        stream, include_usage = bool(req.stream), self.usage_chunk(req)
        events = merge(
            [
                self._shown(
                    fmt, self.engine.generate(ids, params, request_id=f"{fmt.id}-{i}"), stream
                )
                for i, ids in enumerate(prompts)
            ]
        )
        if isinstance(fmt, ResponsesFormat) and fmt.background:
            return self._in_background(fmt, events, len(prompts), params.n)
        try:
            if not stream:
                finals = await until_disconnect(request, self.collect(events, len(prompts)))
                check_not_aborted(finals)
                answer = fmt.response(finals)
                body = answer.model_dump_json()
                return Response(body, media_type="application/json")
            # the first output decides the status (a request the engine refuses is a 4xx), unless
            # it takes longer than --sse-keep-alive-interval: the stream then starts without it
            every = self.engine.config.sse_keep_alive_interval
            coming = asyncio.ensure_future(anext(events))
            try:
                await until_disconnect(request, asyncio.wait({coming}, timeout=every or None))
            except BaseException:
                coming.cancel()
                await asyncio.gather(coming, return_exceptions=True)
                raise
            first = coming.result() if coming.done() else coming  # (a refusal is raised here)
        except BaseException as e:
            await events.aclose()
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        return EventStream(
            self._stream(fmt, first, events, len(prompts), params.n, include_usage), every
        )

    def _in_background(
        self,
        fmt: ResponsesFormat,
        events: AsyncGenerator[tuple[int, RequestOutput], None],
        num: int,
        n: int,
    ) -> Response:
        """Answers with the queued Response and runs it on; it is kept in progress once the
        engine runs it, and as it ends (completed or incomplete, cancelled, failed), for the
        client to retrieve. Streamed (fmt.events), the answer is its stream instead, read from
        the kept events, so that the response runs on if the client goes away."""

        async def started() -> AsyncGenerator[tuple[int, RequestOutput], None]:
            async with aclosing(events):
                async for i, out in events:
                    if fmt.status == "queued":
                        fmt.left("in_progress")
                    yield i, out

        if fmt.id in self.background:
            raise ParamError(
                "request_id",
                f"a background response {fmt.id!r} is running: send another request id",
            )
        log = fmt.events
        made = self._logged(fmt, log, started(), num, n) if log else self.collect(started(), num)
        task = asyncio.create_task(made)
        self.background[fmt.id] = task

        def settle(done: asyncio.Task) -> None:
            self.background.pop(fmt.id, None)
            if log is not None:
                log.end()
            failed = {"code": "server_error", "message": "the server shut down"}
            if done.cancelled():
                fmt.left("cancelled")
                return
            try:
                if (error := done.exception()) is not None:
                    failed["message"] = str(error) or type(error).__name__
                elif log is not None:  # (its stream kept the answer, or says why not)
                    if fmt.status in ("completed", "incomplete"):
                        return
                    failed["message"] = done.result() or failed["message"]
                elif not any(c.finish_reason == "abort" for o in done.result() for c in o.outputs):
                    fmt.response(done.result())  # kept by the format
                    return
            except Exception as e:  # noqa: BLE001 - the answer could not be made: it failed
                failed["message"] = f"the answer could not be made: {e}"
            fmt.left("failed", failed)

        task.add_done_callback(settle)
        queued = fmt.left("queued")
        if log is None:
            return JSONResponse(queued)
        return EventStream(log.read(0), self.engine.config.sse_keep_alive_interval)

    async def _logged(
        self,
        fmt: ResponsesFormat,
        log: EventLog,
        events: AsyncGenerator[tuple[int, RequestOutput], None],
        num: int,
        n: int,
    ) -> str | None:
        """A background response's stream, into its log (opened at once, before the engine runs
        it); why it failed, if it did."""
        failed: list[APIError] = []
        coming = asyncio.ensure_future(anext(events))
        async for frame in self._stream(fmt, coming, events, num, n, False, failed):
            log.add(frame)
        return failed[0].message if failed else None

    async def cancel_response(self, response_id: str) -> dict:
        """Cancels a background response still running (OpenAI's cancel): the kept Response."""
        stored = self.stored_response(response_id)
        task = self.background.get(response_id)
        if task is None:
            raise APIError(
                400,
                f"response {response_id!r} is not running in the background "
                f"(status {stored.body['status']!r}): only a queued one can be cancelled",
                param="response_id",
            )
        task.cancel()
        await asyncio.wait([task])
        return self.stored_response(response_id).body

    async def delete_response(self, response_id: str) -> None:
        """Forgets a kept response (404 if none), stopping it first if it runs in the background
        (else its end would keep it again)."""
        self.stored_response(response_id)
        if response_id in self.background:
            await self.cancel_response(response_id)
        assert self.stored is not None  # (stored_response found it)
        self.stored.delete(response_id)

    async def collect(
        self, events: AsyncGenerator[tuple[int, RequestOutput], None], num: int
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * num
        async with aclosing(events):
            async for i, out in events:
                if out.finished:
                    finals[i] = out
        return all_final(finals)

    async def _stream(
        self,
        fmt: ResponseFormat,
        first: tuple[int, RequestOutput] | asyncio.Future,
        events: AsyncGenerator[tuple[int, RequestOutput], None],
        num: int,
        n: int,
        include_usage: bool,
        failed: list[APIError] | None = None,
    ) -> AsyncGenerator[str, None]:
        """The answer's frames, from the first output (or the future of it, when the stream
        started without it); an error after the stream started ends it as an error event (and is
        put in `failed`, if given)."""
        finals: list[RequestOutput | None] = [None] * num
        sent: dict[int, _Sent] = {}
        try:
            async with aclosing(events):
                if isinstance(first, asyncio.Future):  # (started before it: it waited that long)
                    for waiting in fmt.waiting():
                        yield waiting
                    coming = first
                    try:
                        first = await coming
                    finally:  # (closed while it waits: events cannot close while it runs)
                        if not coming.done():
                            coming.cancel()
                            await asyncio.gather(coming, return_exceptions=True)
                assert isinstance(first, tuple)
                for start in fmt.start(num * n, first[1]):
                    yield fmt.frame(start)
                item: tuple[int, RequestOutput] | None = first
                while item is not None:
                    i, out = item
                    for o in out.outputs:
                        chunk = self._delta(fmt, i * n + o.index, out, o, sent)
                        if chunk is not None:
                            yield fmt.frame(chunk)
                    if out.finished:
                        finals[i] = out
                    item = await anext(events, None)
            done = all_final(finals)
            check_not_aborted(done)
            for last in fmt.closing(done, include_usage):
                yield fmt.frame(last)
        except Exception as e:  # noqa: BLE001 - the status is already sent: report in the stream
            err = to_api_error(e)
            if failed is not None:
                failed.append(err)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        if fmt.done_marker:
            yield fmt.done_marker

    @staticmethod
    def _delta(
        fmt: ResponseFormat,
        index: int,
        out: RequestOutput,
        o: CompletionOutput,
        sent: dict[int, _Sent],
    ) -> BaseModel | None:
        """The chunk for what choice `index` (output `o` of `out`) has produced since the last
        one, if anything."""
        s = sent.setdefault(index, _Sent())
        if s.finished:
            return None
        text = o.text[s.chars :]
        logprobs = o.sample_logprobs[s.logprobs :] if o.sample_logprobs is not None else None
        finished = o.finish_reason is not None
        if not (text or logprobs or finished):
            return None
        delta = Delta(
            index,
            text,
            logprobs,
            s.chars,
            o,
            finished,
            token_ids=o.token_ids[s.tokens :] if fmt.token_ids else [],
            prompt_token_ids=out.prompt_token_ids,
            first=s.chunks == 0,
        )
        chunk = fmt.chunk(delta)
        s.chars, s.finished = len(o.text), finished
        s.logprobs += len(logprobs or ())
        if chunk is not None:
            s.tokens, s.chunks = len(o.token_ids), s.chunks + 1
        return chunk

"""The engine for the server: the step loop runs in a background thread.

Requests and aborts are handed to the loop as commands (AddRequest, Abort) in a
lock-protected inbox and applied between steps; each request's outputs come back
to its asyncio queue with `call_soon_threadsafe`. So the event loop never waits on
the model, and an abort (or a client that goes away) frees the request's blocks
within one step.

A request that fails inside a step is ended alone by the engine (RequestFailedError
to its client). Anything else that escapes the loop stops it for good: every client
waiting, and every later one, gets EngineDeadError at once, and `error` says why, so
the server can report unhealthy and exit for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pagedkv.config import ConfigError, EngineConfig
from pagedkv.engine.engine_stats import EngineStats
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request import SamplingParams
from pagedkv.engine.request_log import RequestLog

log = logging.getLogger("pagedkv")


STATS_INTERVAL_S = 0.2  # stats walk the whole pool: not after every step of a busy engine
FAILED = "the request failed inside the engine"


class QueueFullError(Exception):
    """The waiting queue is at --max-waiting: the client should retry later (HTTP 429)."""


class ShuttingDownError(Exception):
    """The engine is stopping and takes no new request (HTTP 503)."""


class RequestFailedError(Exception):
    """This request failed inside the engine and was ended; the others carry on (HTTP 500)."""


class EngineDeadError(Exception):
    """The engine loop stopped after an error it could not pin on one request (HTTP 503)."""


class _Outputs(asyncio.Queue):
    """A request's outputs on their way to its reader. They are cumulative, so one not read yet
    is replaced by the next, as in vLLM: a reader that lags (a slow client, a busy event loop)
    holds memory linear in the output, not a copy of it per token. Errors and the final output
    are never replaced."""

    def _put(self, item: RequestOutput | Exception) -> None:
        pending = self._queue  # type: ignore[attr-defined]  # asyncio.Queue's own deque
        if (
            pending
            and isinstance(item, RequestOutput)
            and isinstance(pending[-1], RequestOutput)
            and not pending[-1].finished
        ):
            pending[-1] = item
        else:
            pending.append(item)


def _due(out: RequestOutput, sent: list[int], interval: int) -> bool:
    """Whether a streamed output is given (vLLM's --stream-interval): the first with tokens, then
    one where a sequence has `interval` tokens more than the last output given."""
    if interval <= 1:
        return True
    if not any(sent):
        return any(o.token_ids for o in out.outputs)
    return any(
        len(o.token_ids) - (sent[i] if i < len(sent) else 0) >= interval
        for i, o in enumerate(out.outputs)
    )


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None


@dataclass(slots=True)
class Abort:
    request_id: str


Command = AddRequest | Abort


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self._engine_lock = threading.Lock()  # held by a step; snapshots wait for it
        self._wake = threading.Condition()  # guards the inbox and what follows; not held long
        self._stats = self.engine.stats()  # refreshed between steps, read without waiting
        self._stats_time = 0.0
        self._inbox: list[Command] = []
        self._num_waiting = 0  # in the scheduler's queue or the inbox
        self._queues: dict[str, _Outputs] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.request_log = (  # --enable-log-requests; the server logs the answers through it
            RequestLog(config.enable_log_outputs, config.enable_log_deltas, config.max_log_len)
            if config.enable_log_requests
            else None
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        """Start the engine thread on first use, on the event loop that will read the outputs."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop: requests still running are aborted and their streams told so."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.engine.close()

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine loop, if an error did (the server must then restart)."""
        return self._error

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Cumulative outputs as tokens arrive; the last has finished=True (beam search: only
        that one).

        Closing the iterator aborts the request."""
        self._check_accepting()
        self._ensure_started()
        ends = self.engine.special_ends(prompt, add_special_tokens)
        ids = params.truncate(
            self.engine.tokenize(prompt, add_special_tokens), self.max_model_len, ends
        )
        self.engine.validate(ids, params)
        queue = _Outputs()
        with self._wake:
            self._check_accepting()
            if self._num_waiting >= self.config.max_waiting:
                raise QueueFullError(
                    f"the waiting queue is full ({self.config.max_waiting} requests)"
                )
            if request_id in self._queues:
                raise ConfigError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = queue
            self._num_waiting += 1
            text = prompt if isinstance(prompt, str) else None
            self._inbox.append(AddRequest(request_id, ids, params, text))
            self._wake.notify()
        if self.request_log is not None:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
            self.request_log.received(request_id, text, ids, params, decode)
        finished = False
        interval = max(params.stream_interval or 1, self.config.stream_interval)
        sent: list[int] = []  # tokens each sequence had in the last output given
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if not item.finished and not _due(item, sent, interval):
                    continue  # (cumulative: the next output given carries these tokens too)
                sent = [len(o.token_ids) for o in item.outputs]
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    def _check_accepting(self) -> None:
        if self._error is not None:
            raise self._dead()
        if self._stopping:
            raise ShuttingDownError("the server is shutting down")

    async def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(Abort(request_id))
            self._queues.pop(request_id, None)
            self._wake.notify()

    # ------------------------------------------------------------------ adapters
    def load_lora(self, name: str, path: str) -> None:
        """Between two steps (blocks: call it off the event loop)."""
        with self._engine_lock:
            self.engine.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Between two steps; LLMEngine.remove_lora says when it cannot."""
        with self._engine_lock:
            self.engine.remove_lora(name)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        return self._stats

    def kv_snapshot(self) -> dict:
        """Waits for the step in flight: call it off the event loop (asyncio.to_thread)."""
        with self._engine_lock:
            return self.engine.kv_snapshot()

    # ------------------------------------------------------------------ the loop (engine thread)
    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        if isinstance(item, RequestOutput) and item.error is not None:
            item = RequestFailedError(f"{FAILED}: {item.error}")
        queue = self._queues.get(request_id)
        if queue is not None:
            assert self._loop is not None  # set before any request is queued
            self._loop.call_soon_threadsafe(queue.put_nowait, item)
            if isinstance(item, Exception) or item.finished:
                self._queues.pop(request_id, None)

    def _apply(self, inbox: list[Command]) -> None:
        for cmd in inbox:
            if isinstance(cmd, Abort):
                self.engine.abort(cmd.request_id)
                continue
            try:
                group = self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
                group.prompt = cmd.prompt
            except ConfigError as e:
                self._deliver(cmd.request_id, e)
            except Exception as e:  # noqa: BLE001 - this request's problem: end it alone
                log.exception("adding request %s failed", cmd.request_id)
                self.engine.abort(cmd.request_id)
                self._deliver(cmd.request_id, RequestFailedError(f"{FAILED}: {e}"))

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            self._die(e)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self.engine.has_unfinished() and not self._stopping:
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                stopping = self._stopping
            with self._engine_lock:
                self._apply(inbox)
                if stopping:
                    for rid in list(self.engine.groups):
                        out = self.engine.abort(rid)
                        assert out is not None  # rid is one of the engine's groups
                        self._deliver(rid, out)
                    self.engine.close()  # drains the disk tier's write queue
                    self._stats = self.engine.stats()
                    return
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                now = time.monotonic()
                if now - self._stats_time > STATS_INTERVAL_S or not self.engine.has_unfinished():
                    self._stats, self._stats_time = self.engine.stats(), now
                waiting = len(self.engine.scheduler.waiting)
            with self._wake:
                self._num_waiting = waiting + sum(isinstance(c, AddRequest) for c in self._inbox)
            for out in outputs:
                self._deliver(out.request_id, out)

    def _die(self, error: BaseException) -> None:
        """The loop cannot go on: fail every client now, and every later one."""
        log.critical("the engine loop stopped: %s: %s", type(error).__name__, error, exc_info=error)
        with self._wake:
            self._error = error
            queues, self._queues = self._queues, {}
            self._inbox.clear()
        for queue in queues.values():
            assert self._loop is not None  # set before any request is queued
            try:
                self._loop.call_soon_threadsafe(queue.put_nowait, self._dead())
            except RuntimeError:  # the event loop is closed: nobody is waiting
                pass

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(
            f"the engine stopped after an internal error "
            f"({type(self._error).__name__}); the server is restarting"
        )

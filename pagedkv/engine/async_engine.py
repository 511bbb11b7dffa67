"""The engine for the server: the step loop runs in a background thread.

Requests and aborts are handed to the loop through a lock-protected inbox and
applied between steps; each request's outputs come back to its asyncio queue
with `call_soon_threadsafe`. So the event loop never waits on the model, and
an abort (or a client that goes away) frees the request's blocks within one step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator

from pagedkv.config import ConfigError, EngineConfig
from pagedkv.engine.llm_engine import EngineStats, LLMEngine
from pagedkv.engine.request import RequestOutput, SamplingParams

log = logging.getLogger("pagedkv")


STATS_INTERVAL_S = 0.2   # stats walk the whole pool: not after every step of a busy engine


class QueueFullError(Exception):
    """The waiting queue is at --max-waiting: the client should retry later (HTTP 429)."""


class ShuttingDownError(Exception):
    """The engine is stopping and takes no new request (HTTP 503)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self._engine_lock = threading.Lock()   # held by a step; snapshots wait for it
        self._wake = threading.Condition()     # guards the inbox; never held during a step
        self._stats = self.engine.stats()      # refreshed between steps, read without waiting
        self._stats_time = 0.0
        self._inbox: list[tuple] = []          # ("add", rid, ids, params, queue) | ("abort", rid)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
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

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as tokens arrive; the last has finished=True. Closing the iterator aborts."""
        if self._stopping:
            raise ShuttingDownError("the server is shutting down")
        ids = self.engine.tokenize(prompt, add_special_tokens)
        self.engine.validate(ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            if len(self.engine.scheduler.waiting) + len(self._inbox) >= self.config.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
            if request_id in self._queues:
                raise ConfigError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = queue
            self._inbox.append(("add", request_id, ids, params, prompt if isinstance(prompt, str) else None))
            self._wake.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._queues.pop(request_id, None)
            self._wake.notify()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        return self._stats

    def kv_snapshot(self) -> dict:
        """Waits for the step in flight: call it off the event loop (asyncio.to_thread)."""
        with self._engine_lock:
            return self.engine.kv_snapshot()

    # ------------------------------------------------------------------ the loop (engine thread)
    def _deliver(self, request_id: str, item) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, item)
            if isinstance(item, Exception) or item.finished:
                self._queues.pop(request_id, None)

    def _apply(self, inbox: list[tuple]) -> None:
        for cmd in inbox:
            if cmd[0] == "add":
                _, rid, ids, params, prompt = cmd
                try:
                    group = self.engine.add_request(rid, ids, params)
                    group.prompt = prompt
                except ConfigError as e:
                    self._deliver(rid, e)
            else:
                self.engine.abort(cmd[1])

    def _run(self) -> None:
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
                        self._deliver(rid, self.engine.abort(rid))
                    self.engine.close()          # drains the disk tier's write queue
                    self._stats = self.engine.stats()
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug, not a client's mistake: fail the running requests, keep serving
                    log.exception("engine step failed")
                    outputs = []
                    for rid in list(self.engine.groups):
                        self.engine.abort(rid)
                        self._deliver(rid, RuntimeError(f"engine error: {e}"))
                now = time.monotonic()
                if now - self._stats_time > STATS_INTERVAL_S or not self.engine.has_unfinished():
                    self._stats, self._stats_time = self.engine.stats(), now
            for out in outputs:
                self._deliver(out.request_id, out)

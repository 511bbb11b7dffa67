"""The HTTP side of a streamed answer: cancel on disconnect, merge engine streams, SSE.

A client that goes away cancels the work, and closing the engine's iterator
aborts the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

T = TypeVar("T")


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


KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see bytes go by


async def keep_alive(frames: AsyncGenerator[str, None], every: float) -> AsyncGenerator[str, None]:
    """`frames`, with a keep-alive comment whenever they have had nothing to send for `every`
    seconds (vLLM's --sse-keep-alive-interval: a proxy with a read timeout keeps the connection
    through a long queue, prefill or pause)."""
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(frames))
            while not (await asyncio.wait({step}, timeout=every))[0]:
                yield KEEP_ALIVE
            try:
                frame = step.result()
            except StopAsyncIteration:
                return
            yield frame
    finally:
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await frames.aclose()


class EventStream(StreamingResponse):
    """SSE response that always closes its iterator.

    However the stream ends, disconnects included. With `keep_alive_every` seconds, an idle
    stream sends a comment that often."""

    def __init__(self, content: AsyncGenerator[str, None], keep_alive_every: float = 0) -> None:
        if keep_alive_every > 0:
            content = keep_alive(content, keep_alive_every)
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

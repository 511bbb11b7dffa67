"""Responses kept for `previous_response_id` and GET / DELETE /v1/responses/{id} (OpenAI's stored
responses; `store` defaults to true there, and here). A background response is kept from the
start, queued, and replaced as it runs and ends (server/serving.py); a streamed one keeps its
stream's events too, for GET /v1/responses/{id}?stream=true to read again from any point.

A response is kept with its own request's input items and the id of the response it continued,
not the whole conversation again: a chain of N turns holds each item once. The latest
`--max-stored-responses` are kept, the least recently used leaving first; continuing a
conversation touches every response of it, so a chain in use is not evicted from under its next
turn. In memory only: a restart forgets them. Under --data-parallel-size each replica keeps
its own, and the ingress sends a request that needs one to its replica (response_owners.py).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from pagedkv.server.errors import APIError


@dataclass
class EventLog:
    """A background response's stream as it is made: its events in order, so that the request
    that started it, and any GET ?stream=true after (the first, or one that lost its
    connection), read it from the start or from after a sequence number. Event i has
    sequence_number i."""

    events: list[str] = field(default_factory=list)  # server-sent events, each ending "\n\n"
    ended: bool = False
    _grew: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, frame: str) -> None:
        """A frame of one or more events."""
        self.events += [event + "\n\n" for event in frame.split("\n\n") if event]
        self._grew.set()

    def end(self) -> None:
        self.ended = True
        self._grew.set()

    async def read(self, start: int) -> AsyncGenerator[str, None]:
        """The events from the start-th on, as they come, until the stream ends."""
        at = start
        while True:
            self._grew.clear()
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await self._grew.wait()


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the Response as it was answered
    input_items: list[dict[str, Any]]  # its request's input, each item with an id
    previous: str | None  # the response it continued
    events: EventLog | None = None  # a background stream's events (None: not streamed)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        key = stored.body["id"]
        self._kept[key] = stored
        self._kept.move_to_end(key)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None

    def chain(self, response_id: str) -> list[StoredResponse] | str:
        """The responses of the conversation through response_id, oldest first; a response of it
        that is not kept: its id, instead. Each is touched, the oldest first (the latest stays
        the newest)."""
        chain: list[StoredResponse] = []
        at: str | None = response_id
        while at is not None:
            stored = self._kept.get(at)
            if stored is None:
                return at
            chain.append(stored)
            at = stored.previous
        for stored in reversed(chain):
            self._kept.move_to_end(stored.body["id"])
        return chain[::-1]


def conversation(chain: list[StoredResponse]) -> list[dict[str, Any]]:
    """A chain's items: each turn's input, then its output."""
    return [item for stored in chain for item in stored.input_items + stored.body["output"]]


def item_page(items: list[dict], newest_first: bool, limit: int, after: str | None) -> dict:
    """OpenAI's list of items: a page of `limit` from the one after `after`, in the order asked."""
    items = items[::-1] if newest_first else items
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"no input item {after!r} in this response", param="after")
        items = items[at + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }

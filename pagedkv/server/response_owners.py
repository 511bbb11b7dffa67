"""Which replica keeps each stored response: the ingress's map under --data-parallel-size.

Each replica keeps the responses it answered (server/response_store.py). A request that needs one
(`previous_response_id`; GET or DELETE /v1/responses/{id}, its cancel and its input items; a
background response's polls) must reach that replica. The ingress learns the owner from each
whole answer that is a Response, and asks the replicas in turn for one it has not seen (a
streamed answer, or after Ray restarted the ingress). A conversation so stays on one replica,
which also holds its earlier turns' KV blocks. A replica that died takes its responses with it,
as a restart does in one process: the request goes wherever routing sends it, and gets the 404
(or 400) of a response not kept.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

_BY_ID = re.compile(r"/v1/responses/([^/]+)(?:/cancel|/input_items)?/?$")
_CREATE = re.compile(r"/v1/responses/?$")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:  # (the replica answers a body it cannot read)
        return {}
    return data if isinstance(data, dict) else {}


def needed_response(method: str, path: str, body: bytes) -> str | None:
    """The stored response a request reads, continues or changes (None: any replica serves it)."""
    if (by_id := _BY_ID.search(path)) is not None:
        return by_id.group(1)  # (the ASGI path: already decoded)
    if method == "POST" and _CREATE.search(path):
        previous = _json_object(body).get("previous_response_id")
        return previous if isinstance(previous, str) and previous else None
    return None


def created_response(method: str, path: str, status: int, body: bytes) -> str | None:
    """The id of the Response a whole answer to POST /v1/responses carries (a background one's is
    its queued Response), if it was kept (`store`)."""
    if method != "POST" or status != 200 or not _CREATE.search(path):
        return None
    answer = _json_object(body)
    if answer.get("object") != "response" or answer.get("store") is not True:
        return None
    return answer["id"] if isinstance(answer.get("id"), str) else None


class ResponseOwners:
    """Response id -> the name of the replica that keeps it; the least recently used leave first
    beyond `capacity` (the replicas' stores together hold no more)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def get(self, response_id: str) -> str | None:
        owner = self._owner.get(response_id)
        if owner is not None:
            self._owner.move_to_end(response_id)
        return owner

    def put(self, response_id: str, replica: str) -> None:
        self._owner[response_id] = replica
        self._owner.move_to_end(response_id)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def drop(self, response_id: str) -> None:
        self._owner.pop(response_id, None)

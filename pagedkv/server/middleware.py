"""ASGI middleware: the header-count and request-body caps, the API key, and the headers naming
dropped fields and the request's id.

All are plain ASGI: the first three run before FastAPI parses anything (an oversized
body is refused without being held in memory, a request without the key never
reaches the engine); the others add a header to a reply, streamed or not.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.config import is_digits
from pagedkv.server.errors import APIError, error_response
from pagedkv.server.protocol import CLASSIFY_PATHS, RERANK_PATHS, SCORE_PATHS

MAX_BODY_BYTES = 8 * 2**20
MAX_HEADER_COUNT = 256  # vLLM's --h11-max-header-count default
IGNORED_HEADER = "x-pagedkv-ignored-fields"
REQUEST_ID_HEADER = "x-request-id"


def adding_header(send: Send, name: str, value: Callable[[], bytes | None]) -> Send:
    """`send`, adding the header `name` to the reply's start, with what `value()` gives then
    (nothing when None)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and (v := value()) is not None:
            message = {**message, "headers": [*message.get("headers", ()), (name.encode(), v)]}
        await send(message)

    return sending


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not is_digits(length) or int(length) > self.max_bytes):
            await error_response(self._too_large())(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()  # FastAPI's handler for APIError answers 413
            return message

        await self.app(scope, limited, send)


class HeaderCountLimit:
    """431 for a request with more than `max_count` header lines (vLLM's --h11-max-header-count),
    before any route reads them."""

    def __init__(self, app: ASGIApp, max_count: int = MAX_HEADER_COUNT) -> None:
        self.app, self.max_count = app, max_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_count:
            err = APIError(
                431,
                f"the request has {len(scope['headers'])} headers; the limit is {self.max_count}",
            )
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BearerAuth:
    """With an API key set, every /v1 route needs `Authorization: Bearer <key>`.

    The key is compared in constant time. /health, /metrics and the dashboard page stay open,
    as in vLLM; the page asks for the key and sends it on its own /v1 calls.
    """

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1") -> None:
        self.app, self.key, self.prefix = app, api_key.encode(), prefix

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(self.prefix)
            and not self._authorized(scope)
        ):
            err = APIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class IgnoredFieldsHeader:
    """Names, in IGNORED_HEADER, the request fields the route dropped (`request.state.ignored`,
    set by app.read_json), so that a client can see what was not used."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        def named() -> bytes | None:
            ignored = scope.get("state", {}).get("ignored")
            return ignored.encode("ascii") if ignored else None

        await self.app(scope, receive, adding_header(send, IGNORED_HEADER, named))


class RequestIdHeader:
    """`--enable-request-id-headers`, as vLLM: every reply carries X-Request-Id, the client's own or
    a new one. A new one is also set on the request, so that a completion's id ends with it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        value = (given if given is not None else uuid.uuid4().hex).encode("latin-1")
        if given is None:
            scope = {**scope, "headers": [*scope["headers"], (REQUEST_ID_HEADER.encode(), value)]}

        await self.app(scope, receive, adding_header(send, REQUEST_ID_HEADER, lambda: value))


class ServerLoad:
    """vLLM's GET /load: the model's requests in flight (generations, embeddings, scores, labels,
    `app.state.server_load`), from their arrival until their answer's last byte, streamed or not."""

    PATHS = frozenset(
        {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"}
        | {*SCORE_PATHS, *RERANK_PATHS, *CLASSIFY_PATHS, "/pooling", "/invocations"}
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.PATHS:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load -= 1

"""OpenAI-shaped errors: every failure becomes `{"error": {message, type, param, code}}`.

Clients written for OpenAI read `error.message` and branch on the status, so a
client's mistake must always be a 4xx with that body, never a bare 500 or a
FastAPI `{"detail": ...}`.
"""

from __future__ import annotations

import logging
import re

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.config import ConfigError

log = logging.getLogger("pagedkv.server")

# status -> (OpenAI error type, default code)
_TYPES = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    431: ("invalid_request_error", "request_header_fields_too_large"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", None),
    503: ("server_error", "service_unavailable"),
}


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = (
            status,
            message,
            param,
            code,
            headers,
        )


def _printable(text: str | None) -> str | None:
    """Lone surrogates from the request escaped: echoing a bad value must not break the encoder."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """The OpenAI error object; `code` defaults to one that names the status."""
    kind, default_code = _TYPES.get(
        status, ("invalid_request_error" if status < 500 else "server_error", None)
    )
    return {
        "error": {
            "message": _printable(message),
            "type": kind,
            "param": _printable(param),
            "code": code if code is not None else default_code,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.param, err.code),
        status_code=err.status,
        headers=err.headers,
    )


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to its HTTP error."""
    from pagedkv.engine.async_engine import (  # late: keeps torch out of import time
        EngineDeadError,
        QueueFullError,
        RequestFailedError,
        ShuttingDownError,
    )

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc), param=getattr(exc, "param", None))  # ParamError names it
    if isinstance(exc, jinja2.TemplateError):
        return APIError(400, f"chat template error: {exc}")
    if isinstance(exc, QueueFullError):
        return APIError(
            429, str(exc) or "the waiting queue is full; retry later", headers={"Retry-After": "1"}
        )
    if isinstance(exc, (ShuttingDownError, EngineDeadError)):
        return APIError(503, str(exc))
    if isinstance(exc, RequestFailedError):  # logged with its traceback by the engine
        return APIError(500, str(exc), code="request_failed")
    log.exception("internal error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}")


# the tag pydantic puts in an error's location for the member of a union that was tried
# ("literal[...]", "function-after[...]", "list[int]", "str", "NamedToolChoice"): not a field
_UNION_TAG = re.compile(r"[\[\]()']|^(str|int|float|bool|dict|list|none)$|^[A-Z]")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as one readable line, plus the parameter it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [
        str(p)
        for p in first.get("loc", ())
        if p not in ("body", "query") and not (isinstance(p, str) and _UNION_TAG.search(p))
    ]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if param is None or (first.get("type") == "value_error" and msg.startswith(loc[0])):
        return msg, param  # our own validators name the field already
    return f"{param}: {msg}", param


def install_error_handlers(app: FastAPI) -> None:
    from pagedkv.engine.async_engine import (
        EngineDeadError,
        QueueFullError,
        RequestFailedError,
        ShuttingDownError,
    )

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))

    for kind in (
        APIError,
        ConfigError,
        jinja2.TemplateError,
        QueueFullError,
        ShuttingDownError,
        RequestFailedError,
        EngineDeadError,
    ):
        app.add_exception_handler(kind, _known)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        )

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))

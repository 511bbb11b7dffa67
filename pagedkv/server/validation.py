"""What a request body may carry, checked where it enters: strict JSON and reusable field types.

Everything here is about shape, not meaning: JSON without NaN/Infinity,
integers that fit in 64 bits, finite floats, text without lone surrogates,
bounded lists. What a value means (top_p in (0, 1], a token id inside the
vocabulary) is decided in one place, `SamplingParams.validate` and the
engine, so the server and the offline API agree. New request fields should
be declared with these types so they get the same checks.

Unknown fields are dropped, as vLLM drops them (clients send newer OpenAI fields
such as `store`), but not silently: a RequestModel validated with a context
collects their names under IGNORED, which the server logs and returns in the
`X-PagedKV-Ignored-Fields` header (app.read_json).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator
from pydantic.fields import FieldInfo

from pagedkv.config import ConfigError
from pagedkv.engine.request import INT64_MAX, INT64_MIN, valid_text
from pagedkv.server.errors import APIError

MAX_PROMPTS = 1024  # prompts in one /v1/completions batch (each is its own engine request)
MAX_MESSAGES = 2048  # messages in one chat
MAX_NAME_CHARS = 256  # model, user, message name
T = TypeVar("T")


def _check_text(text: str) -> str:
    if not valid_text(text):
        raise ValueError("must be valid Unicode text (it holds a lone surrogate)")
    return text


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""An integer torch and numpy can hold (ranges are SamplingParams' business)."""
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A token id; whether it is inside the vocabulary is checked by the engine, which knows it."""
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
"""A float that is not NaN or +-inf (1e400 in JSON reads as inf)."""
SafeStr = Annotated[str, AfterValidator(_check_text)]
"""Text a tokenizer can encode: no lone surrogates ("\\ud800" is valid JSON but not Unicode)."""
Name = Annotated[SafeStr, Field(max_length=MAX_NAME_CHARS)]
"""A short identifier: a model name, a user id."""


def documented(**bounds: Any) -> FieldInfo:
    """JSON-schema bounds (minimum=, maximum=, maxItems=...) for /openapi.json only.

    SamplingParams.validate enforces them, with its own messages; declaring
    them lets clients and the schema-driven fuzzer see the valid ranges.
    """
    return Field(json_schema_extra=bounds)


def check_text(text: Any, what: str) -> None:
    """For the hand-written validators of union-shaped fields (prompt, stop, content)."""
    if isinstance(text, str) and not valid_text(text):
        raise ValueError(f"{what} must be valid Unicode text (it holds a lone surrogate)")


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def load_json_object(body: bytes) -> dict:
    """The body as a JSON object, strictly: UTF-8, no NaN/Infinity, not absurdly nested; else 400.

    Python's json accepts NaN and Infinity, raises ValueError past 4300
    digits and RecursionError on deep nesting: all are the client's mistake.
    """
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def checked(param: str, check: Callable[[Any], T], value: Any) -> T:
    """`check(value)`, its ConfigError turned into a 400 naming `param` (for query parameters)."""
    try:
        return check(value)
    except ConfigError as e:
        raise APIError(400, str(e), param=param) from None


IGNORED = "ignored"  # the validation context's key for the names of the fields dropped


def note_ignored(info: ValidationInfo, where: str, keys: Iterable[object]) -> None:
    """Adds fields that nothing reads to the context's IGNORED set (when validating with one)."""
    names = {f"{where}{k}" for k in keys}
    if names and isinstance(info.context, dict):
        info.context.setdefault(IGNORED, set()).update(names)


class RequestModel(BaseModel):
    """A request body or a part of one: strict types; unknown fields dropped and named."""

    model_config = ConfigDict(strict=True, extra="ignore")
    where: ClassVar[str] = ""  # this model's place in a request, prefixed to the names
    understood: ClassVar[frozenset[str]] = frozenset()  # read by a validator, not a field
    # fields OpenAI's spec (and vLLM) let be null, meaning their default: SDKs that send every
    # field send them so
    nullable: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown(cls, data: Any, handler: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict):
            if isinstance(info.context, dict):
                fields = cls.model_fields
                known = fields.keys() | {f.alias for f in fields.values() if f.alias}
                note_ignored(info, cls.where, data.keys() - known - cls.understood)
            data = {k: v for k, v in data.items() if v is not None or k not in cls.nullable}
        return handler(data)

"""vLLM's request fields beyond the sampling ones: output constraints, tools, and the fields pagedkv
does not implement, which are answered with a 400 that names them instead of being ignored.

The models are used by protocol.py's request classes; the resolution of the several ways vLLM
accepts to ask for structured output (`structured_outputs`, `guided_*`, `response_format`) into one
`StructuredOutputsParams` lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from pagedkv.engine.request import ParamError, StructuredOutputsParams
from pagedkv.server.validation import RequestModel, SafeStr

# field -> the values that mean "not used"; any other value is a 400 naming the field
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logits_processors": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
    "mm_processor_kwargs": (None,),
    "guided_whitespace_pattern": (None,),
    "audio": (None,),
    "modalities": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),
    "function_call": (None,),
    "structural_tag": (None,),
    # vLLM 0.32's for what pagedkv has not: multimodal inputs, disaggregated encoder caches,
    # watermarks, the render endpoints' offsets, a mixture's routing record
    "mm_payload": (None,),
    "media_io_kwargs": (None,),
    "ec_transfer_params": (None,),
    "watermarking": (None, False),
    "return_token_offsets": (None, False),
    "return_mm_kwargs": (None, True),
    "routed_experts_prompt_start": (None, 0),
}
GUIDED_BACKENDS = (None, "auto", "guidance", "llguidance")


def refusing(
    table: dict[str, tuple[Any, ...]], why: dict[str, str] | None = None
) -> Callable[[Any], Any]:
    """A before-validator: a field of `table` set to other than its "not used" values is a 400,
    with the reason `why` gives for it, else that pagedkv does not support it."""

    def check(data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in table.items():
                if name in data and data[name] not in unused:
                    raise ValueError((why or {}).get(name, f"{name} is not supported by pagedkv"))
        return data

    return check


reject_unsupported = refusing(UNSUPPORTED)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Model):
    name: SafeStr
    description: SafeStr | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Model):
    name: SafeStr


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCall(RequestModel):
    where = "messages[].tool_calls[].function."
    name: SafeStr
    arguments: SafeStr


class ToolCall(RequestModel):
    where = "messages[].tool_calls[]."
    id: SafeStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first has id, type and name; later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


def structured_spec(req) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, from whichever field; 400 if several."""
    if req.guided_decoding_backend not in GUIDED_BACKENDS:
        raise ParamError(
            "guided_decoding_backend",
            f"guided_decoding_backend {req.guided_decoding_backend!r} is not available; "
            "pagedkv uses llguidance",
        )
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_dict(req.structured_outputs)))
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field)
        if value is not None:
            found.append((field, StructuredOutputsParams(**{key: value})))
    if req.response_format is not None and req.response_format.type != "text":
        found.append(("response_format", _from_response_format(req.response_format)))
    if len(found) > 1:
        raise ParamError(
            found[1][0],
            f"only one output constraint may be given; got {', '.join(f for f, _ in found)}",
        )
    return found[0][1] if found else None


def _from_dict(data: dict) -> StructuredOutputsParams:
    data = {k: v for k, v in data.items() if v is not None}
    backend = data.pop("backend", None)
    if backend not in GUIDED_BACKENDS:  # as guided_decoding_backend: not dropped unread
        raise ParamError(
            "structured_outputs",
            f"structured_outputs.backend {backend!r} is not available; pagedkv uses llguidance",
        )
    data.pop("disable_any_whitespace", None)  # pagedkv's JSON never has optional whitespace
    unknown = sorted(set(data) - {"json", "regex", "choice", "grammar", "json_object"})
    if unknown:
        raise ParamError(
            "structured_outputs", f"structured_outputs.{unknown[0]} is not supported by pagedkv"
        )
    return StructuredOutputsParams(**data)


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ParamError("response_format", "response_format json_schema needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)

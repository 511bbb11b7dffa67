"""OpenAI's Responses API request (POST /v1/responses), served as a chat completion.

A response is one chat turn: `instructions` becomes a system message, `input` (a string, or a
list of items: text messages, function calls and their outputs) the conversation, `tools`
(function tools) and `tool_choice` the chat's, `text.format` the response_format, and
`max_output_tokens` the completion limit. The sampling extensions of /v1/chat/completions (seed,
top_k, stop, ...) pass through under their names. A response may continue a stored one
(`previous_response_id`: its conversation comes first, its instructions do not carry over, as in
OpenAI's; server/response_store.py), or run in the background (`background`: the answer is the
queued response, the client polls for it). What a text-only server cannot do is a 400 naming the
field: conversations (`conversation`), hosted tools (web search, files, MCP ...), images and
files, `include`, `top_logprobs`, `reasoning` options, `truncation: "auto"` and stored prompts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, TypeAdapter, model_validator

from pagedkv.engine.request import ParamError
from pagedkv.server.protocol import ChatCompletionRequest, Count, ReasoningEffort
from pagedkv.server.request_fields import refusing
from pagedkv.server.validation import (
    MAX_MESSAGES,
    FiniteFloat,
    Name,
    RequestModel,
    SafeStr,
)
from pagedkv.server.validation import documented as doc

# field -> the values that mean "not used"; any other value is a 400 naming the field
RESPONSES_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "conversation": (None,),
    "include": (None, []),
    "top_logprobs": (None, 0),
    "prompt": (None,),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "stream_options": (None,),
}
WHY = {
    "conversation": "conversations are not stored: send the whole conversation as input, or "
    "previous_response_id",
}
# /v1/chat/completions fields a response passes on as they are
CHAT_EXTENSIONS = (
    "seed",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "priority",
    "request_id",
    "cache_salt",
    "chat_template_kwargs",
    "skip_special_tokens",
    "include_reasoning",
    "thinking_token_budget",
)
TEXT_PARTS = ("input_text", "output_text")


def _check_content(value: Any) -> Any:
    """A string is one text part; parts other than text are refused by their type."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    for part in value if isinstance(value, list) else ():
        if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
            raise ValueError(
                f"content parts of type {part.get('type')!r} are not supported: only "
                "input_text and output_text (this is a text model)"
            )
    return value


class ContentPart(RequestModel):
    where = "input[].content[]."
    understood = frozenset({"annotations", "logprobs"})  # an earlier answer's, sent back
    type: Literal["input_text", "output_text"]
    text: SafeStr


ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _check_input(value: Any) -> Any:
    """A string is one user message; an item without a type is a message; other item types
    (hosted tools' calls, computer use, item references) are refused by their type."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        return value
    items = []
    for item in value:
        if isinstance(item, dict):
            item = {"type": "message", **item}
            if item["type"] not in ITEM_TYPES:
                raise ValueError(
                    f"input items of type {item['type']!r} are not supported: only messages of "
                    "text, function_call, function_call_output and reasoning"
                )
        items.append(item)
    return items


class InputMessage(RequestModel):
    where = "input[]."
    understood = frozenset({"id", "status"})  # an earlier answer's, sent back
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[
        list[ContentPart],
        BeforeValidator(_check_content, json_schema_input_type=SafeStr | list[ContentPart]),
    ]

    def text(self) -> str:
        return "".join(part.text for part in self.content)


class FunctionCallItem(RequestModel):
    """A call the model made, sent back with the conversation."""

    where = "input[]."
    understood = frozenset({"id", "status"})
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: SafeStr


class FunctionCallOutputItem(RequestModel):
    """What the client's function returned for a call."""

    where = "input[]."
    understood = frozenset({"id", "status"})
    type: Literal["function_call_output"]
    call_id: Name
    output: SafeStr


class ReasoningText(RequestModel):
    where = "input[].content[]."
    type: Literal["reasoning_text"]
    text: SafeStr


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning, sent back: the next assistant turn's `reasoning`."""

    where = "input[]."
    understood = frozenset({"id", "status", "summary"})
    type: Literal["reasoning"]
    content: list[ReasoningText] = []


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]
_ITEMS = TypeAdapter(list[InputItem])
_ID_PREFIX = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


class FunctionTool(RequestModel):
    where = "tools[]."
    type: Literal["function"]
    name: Name
    description: SafeStr | None = None
    parameters: dict | None = None
    strict: bool | None = None


def _check_tool(tool: Any) -> Any:
    if isinstance(tool, dict) and tool.get("type") != "function":
        raise ValueError(
            f"tools of type {tool.get('type')!r} are not supported: only function tools"
        )
    return tool


class NamedFunction(RequestModel):
    where = "tool_choice."
    type: Literal["function"]
    name: Name


class TextFormat(RequestModel):
    where = "text.format."
    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: SafeStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs its schema")
        return self


class ReasoningOptions(RequestModel):
    """OpenAI's `reasoning`: its effort reaches the chat template as chat's reasoning_effort
    does; a summary is not made (the reasoning comes back whole, as a reasoning item)."""

    where = "reasoning."
    understood = frozenset({"summary", "generate_summary"})
    effort: ReasoningEffort | None = None
    _no_summary = model_validator(mode="before")(
        refusing(
            {"summary": (None,), "generate_summary": (None,)},
            {
                name: f"reasoning.{name} is not supported: the reasoning comes back whole, as a "
                "reasoning item (with --reasoning-parser)"
                for name in ("summary", "generate_summary")
            },
        )
    )


class TextConfig(RequestModel):
    where = "text."
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # (GPT-5's; only the default is meaningful here)


class ResponsesRequest(RequestModel):
    """The Responses API's request, checked as strictly as the chat request it becomes."""

    nullable = frozenset({"stream", "parallel_tool_calls", "tool_choice", "metadata"})
    understood = frozenset(RESPONSES_UNSUPPORTED) | frozenset(CHAT_EXTENSIONS)
    model: Name | None = None
    input: Annotated[
        list[InputItem],
        Field(min_length=1, max_length=MAX_MESSAGES),
        BeforeValidator(_check_input, json_schema_input_type=SafeStr | list[InputItem]),
    ]
    instructions: SafeStr | None = None
    max_output_tokens: Count | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    stream: bool = False
    text: TextConfig | None = None
    metadata: Annotated[dict[Name, SafeStr], doc(maxProperties=16)] | None = None
    user: Name | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_check_tool)]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    store: bool | None = None  # (None: OpenAI's default, true)
    background: bool = False  # answered at once, queued; the client polls for the rest
    previous_response_id: Name | None = None
    reasoning: ReasoningOptions | None = None
    _unsupported = model_validator(mode="before")(refusing(RESPONSES_UNSUPPORTED, WHY))
    # the chat extensions, kept as sent: the chat request they join types and checks them
    _extensions: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _take_extensions(cls, data: Any, handler: Any) -> Any:
        found = {k: data[k] for k in CHAT_EXTENSIONS if k in data} if isinstance(data, dict) else {}
        model = handler({k: v for k, v in data.items() if k not in found} if found else data)
        model._extensions = found
        return model

    @model_validator(mode="after")
    def _check_metadata(self) -> ResponsesRequest:
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError("metadata holds at most 16 keys")
        return self

    def messages(self, earlier: list[InputItem] | None = None) -> list[dict]:
        """The chat this response continues: the instructions first, as a system message, then
        the earlier items (a stored conversation's) and the input; calls join the assistant turn
        before them (or make one), outputs are tool messages."""
        turns: list[dict] = []
        if self.instructions is not None:
            turns.append({"role": "system", "content": self.instructions})
        thought: str | None = None  # a reasoning item's, for the assistant turn after it
        for item in [*(earlier or ()), *self.input]:
            if isinstance(item, ReasoningItem):
                thought = "".join(part.text for part in item.content)
                continue
            if isinstance(item, FunctionCallOutputItem):
                turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            elif isinstance(item, InputMessage):
                turns.append({"role": item.role, "content": item.text()})
            elif not (turns and turns[-1]["role"] == "assistant" and thought is None):
                turns.append({"role": "assistant", "content": ""})
            if isinstance(item, FunctionCallItem):
                call = {"name": item.name, "arguments": item.arguments}
                turns[-1].setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": call}
                )
            if thought is not None and turns[-1]["role"] == "assistant":
                turns[-1]["reasoning"], thought = thought, None
        if thought is not None:
            raise ParamError(
                "input", "a reasoning item must come before the assistant output it belongs to"
            )
        return turns

    def reported_tools(self) -> tuple[list[dict], str | dict]:
        """tools and tool_choice as a Response reports them (OpenAI's default choice: auto)."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        choice = self.tool_choice or "auto"
        return tools, choice if isinstance(choice, str) else choice.model_dump()

    def chat_tools(self) -> dict:
        """tools and tool_choice in the chat request's shape; without tools only a choice that
        needs them goes on (to be refused there)."""
        choice = self.tool_choice
        named = isinstance(choice, NamedFunction)
        if not self.tools:
            return {"tool_choice": "required"} if choice == "required" or named else {}
        tools = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in self.tools
        ]
        if isinstance(choice, NamedFunction):
            return {
                "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": choice.name}},
            }
        return {
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def text_format(self) -> dict:
        """text.format as a Response reports it."""
        fmt = self.text.format if self.text else None
        return fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        if fmt.description is not None:
            spec["description"] = fmt.description
        return {"type": "json_schema", "json_schema": spec}

    def chat_request(self, context: dict, earlier: list[dict] | None = None) -> ResponsesChat:
        """The chat completion request this response is served as, after `earlier` items (a
        stored conversation's, as kept: OpenAI's output items are input items). 400s name this
        request's fields: see ResponsesChat.wire_param."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(_ITEMS.validate_python(earlier) if earlier else None),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "response_format": self.response_format(),
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            **self.chat_tools(),
            **self._extensions,
        }
        return ResponsesChat.model_validate(
            {k: v for k, v in body.items() if v is not None}, context=context
        )


class ResponsesChat(ChatCompletionRequest):
    """A response's chat request: faults are named by the Responses API's field names."""

    def wire_param(self, param: str) -> str:
        return {
            "max_tokens": "max_output_tokens",
            "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format",
            "messages": "input",
            "prompt": "input",
        }.get(param, param)


def input_items(req: ResponsesRequest, response_id: str) -> list[dict]:
    """The request's input items as a stored response keeps them, each with an id made from the
    response's."""
    suffix = response_id.removeprefix("resp_")
    return [
        {"id": f"{_ID_PREFIX[item.type]}_{suffix}_in{i}", **item.model_dump(exclude_none=True)}
        for i, item in enumerate(req.input)
    ]

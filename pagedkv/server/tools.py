"""Tools in a chat request: what the template sees, what constrains the output, how it is read.

- `tool_choice` "none": the tools reach the template, the output is plain text (as vLLM).
- "auto" (the default when tools are given): needs `--enable-auto-tool-choice --tool-call-parser
  NAME`, else a 400 as in vLLM; the output is read for calls in that parser's format
  (server/tool_parsers.py).
- "required" or a named function: the output is forced by a grammar to be Hermes tool call blocks
  whose JSON is `{"name": <one of the tools>, "arguments": <that tool's parameters schema>}`, so it
  always parses; one block when `parallel_tool_calls` is false or a function is named.

A chat template that never mentions `tools` (SmolLM2's) cannot show them to the model, so the
messages are rewritten the way Hermes models are trained: a system prompt listing the tools as JSON
(appended to the conversation's own system message, or as a new first message) and saying how to
call them, assistant tool calls written in the content and tool results as `<tool_response>` blocks.
The calls are written, and the model told to write them, in the format the output will be read in:
Hermes blocks for "required" and named calls, else the server's parser's (Hermes without one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.config import ConfigError, EngineConfig
from pagedkv.engine.chat import content_text, render_chat
from pagedkv.engine.request import ParamError
from pagedkv.engine.structured import JSON_OPTIONS
from pagedkv.server.tool_parsers import PARSERS, HermesToolParser, ToolParser, tool_parser

if TYPE_CHECKING:
    from pagedkv.server.protocol import ChatCompletionRequest

TOOLS_SYSTEM_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the "
    "user query. Here are the available tools: <tools> {tools} </tools>\n"
)


@dataclass
class ToolPlan:
    parser: ToolParser | None = None  # None: the output is plain text
    grammar: str | None = None  # Lark grammar forcing the calls (required / named)


def plan_tools(req: ChatCompletionRequest, config: EngineConfig) -> ToolPlan:
    """Check tools / tool_choice against each other and the server's flags."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise ParamError("tool_choice", "tool_choice needs tools")
    single = req.parallel_tool_calls is False
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise ParamError(
                "tool_choice",
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
            )
        properties = {  # (qwen3_coder types each value by its parameter's schema)
            t.function.name: (t.function.parameters or {}).get("properties") or {} for t in tools
        }
        parser = tool_parser(config.tool_call_parser, 1 if single else None, properties)
        return ToolPlan(parser)
    if choice == "required":
        chosen = tools
    else:
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ParamError(
                "tool_choice",
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
            )
        single = True
    # forced calls are Hermes blocks, their ids as the model's own format has them
    ids = PARSERS[config.tool_call_parser].id_length if config.tool_call_parser else None
    forced = HermesToolParser(max_calls=1 if single else None, id_length=ids)
    return ToolPlan(forced, call_grammar(chosen, single))


def call_grammar(tools: list, single: bool) -> str:
    """Lark (llguidance) for one or more `<tool_call>` blocks calling one of `tools`.

    Each tool's parameters sit whole under the root's `$defs` (as `tool<i>`), their references
    rebased there, so that a schema means here what it means as a response_format (`#/$defs/x`,
    `#/definitions/x`, `#/properties/a`, `#`), and two tools' `$defs` never meet."""
    defs: dict = {}
    schemas = []
    for i, t in enumerate(tools):
        try:
            defs[f"tool{i}"] = _rebased(
                t.function.parameters or {"type": "object"}, f"#/$defs/tool{i}"
            )
        except ConfigError as e:
            raise ParamError("tools", f"tool {t.function.name!r}: parameters: {e}") from None
        schemas.append(
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": {"$ref": f"#/$defs/tool{i}"},
                },
            }
        )
    schema = dict(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    schema["x-guidance"] = JSON_OPTIONS
    schema["$defs"] = defs
    call = '"<tool_call>\\n" %json ' + json.dumps(schema) + ' "\\n</tool_call>"'
    return f'start: call{"" if single else " (chr_nl call)*"}\nchr_nl: "\\n"\ncall: {call}\n'


_LITERALS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with every local reference ("#...") made relative to `base` instead of the root."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in _SCHEMA_MAPS:  # names -> schemas: any name is a name
            if not isinstance(v, dict):
                raise ConfigError(f"{k} must be an object, got {type(v).__name__}")
            out[k] = {name: _rebased(s, base) for name, s in v.items()}
        else:
            out[k] = v if k in _LITERALS else _rebased(v, base)
    return out


def template_kwargs(req, defaults: dict) -> dict:
    """The chat template's arguments: --default-chat-template-kwargs under the request's own, and
    its reasoning_effort (chat completions), as vLLM passes it: as such, and as enable_thinking
    (false for "none") unless the request's own arguments set that."""
    own = req.chat_template_kwargs or {}
    effort = getattr(req, "reasoning_effort", None)
    if effort is None:
        return {**defaults, **own}
    thinking = {} if "enable_thinking" in own else {"enable_thinking": effort != "none"}
    return {**defaults, **own, **thinking, "reasoning_effort": effort}


def chat_prompt(tokenizer, req, config: EngineConfig, parser: ToolParser | None = None) -> str:
    """A chat request (chat completions or /tokenize) as prompt text: template arguments, tools,
    history, continuation; `parser`: the format calls are read in (default: the server's). A
    template sent with the request runs only on a server started with
    --trust-request-chat-template (as in vLLM: rendering one can take the server's CPU and
    memory). The tools are shown to the model even with tool_choice "none", as in vLLM, unless
    --exclude-tools-when-tool-choice-none."""
    own = req.chat_template_kwargs or {}
    defaults = config.default_chat_template_kwargs or {}
    assert isinstance(defaults, dict)  # EngineConfig parsed the flag's JSON
    sent = (  # the field that carries a template sent with the request
        "chat_template"
        if req.chat_template is not None
        else "chat_template_kwargs"
        if own.get("chat_template") is not None
        else None
    )
    if sent and not config.trust_request_chat_template:
        raise ParamError(
            sent,
            "a chat template sent with the request runs only on a server started with "
            "--trust-request-chat-template",
        )
    messages = [m.as_template_input() for m in req.messages]
    shown = req.tools and not (
        config.exclude_tools_when_tool_choice_none and getattr(req, "tool_choice", None) == "none"
    )
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if shown else None
    template = req.chat_template or tokenizer.chat_template or ""
    if "tool" not in template and (
        tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    ):
        if parser is None:
            parser = tool_parser(config.tool_call_parser or HermesToolParser.name)
        messages = plain_tool_messages(messages, tools, parser)
    try:
        return render_chat(
            tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            tools=tools,
            documents=req.documents,
            chat_template_kwargs=template_kwargs(req, defaults),
            content_format=config.chat_template_content_format,
        )
    except ParamError:
        raise
    except ConfigError as e:  # the template failed: the one sent, or the model's on these messages
        raise ParamError(sent or "messages", str(e)) from None


def plain_tool_messages(
    messages: list[dict], tools: list[dict] | None, parser: ToolParser
) -> list[dict]:
    """The conversation for a template that knows no tools, calls in `parser`'s format (see the
    module docstring)."""
    out = []
    for m in messages:
        content = content_text(m["content"])  # such a template takes text
        if m.get("tool_calls"):
            content += parser.write(
                [
                    (c["function"]["name"], _arguments(c["function"]["arguments"]))
                    for c in m["tool_calls"]
                ]
            )
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "content": content})
    if tools:
        prompt = TOOLS_SYSTEM_PROMPT.format(tools=json.dumps(tools)) + parser.instructions
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments(text: Any) -> Any:
    """A past call's arguments (OpenAI's JSON text) as a value, to be written in a format; text
    that is not JSON stays text."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text

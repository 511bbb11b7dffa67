"""Tool calls in model output, Hermes style:
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`.

One parser serves both answers: `parse(text, final=True)` for the whole output, and the same call on
the text so far while streaming, where it returns only what can no longer change (content before a
possible `<tool_call>`, a name once its closing quote is out, the arguments up to what could still
turn out to close the call). `ToolCallStream` turns successive parses into OpenAI's
`delta.tool_calls` pieces, so the pieces of a stream add up to the non-streamed answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagedkv.engine.reasoning import hold_back
from pagedkv.server.request_fields import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str | None
    arguments: str  # JSON text; while streaming, the part that can no longer change
    complete: bool


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class HermesToolParser:
    max_calls: int | None = None  # 1 when parallel_tool_calls is false: later calls are dropped
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(self.start)
        if at == -1:
            return ParsedOutput(text if final else hold_back(text, self.start))
        calls = []
        for block in text[at:].split(self.start)[1:]:
            body, closed = block.split(self.end, 1)[0], self.end in block
            call = _parse_call(body, complete=closed or final)
            if call is None:  # not a tool call after all (the model wrote the tag in prose)
                return ParsedOutput(text if final else text[:at])
            calls.append(call)
        del calls[self.max_calls or len(calls) :]
        return ParsedOutput(text[:at], calls)


def _parse_call(body: str, complete: bool) -> ParsedCall | None:
    return _complete_call(body) if complete else _partial_call(body)


def _complete_call(body: str) -> ParsedCall | None:
    """A whole block: its JSON decides; the arguments keep the model's own text when it is that JSON
    (so they equal what was streamed), else they are re-serialized."""
    try:
        obj = json.loads(body)
    except (
        ValueError,
        RecursionError,
    ):  # not JSON, or nested deeper than Python parses: not a call
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments sent as a JSON string: its content
        return ParsedCall(obj["name"], args, True)
    raw, whole = _raw_arguments(body)
    if not (whole and json.loads(raw) == args):
        raw = json.dumps(args, ensure_ascii=False)
    return ParsedCall(obj["name"], raw, True)


def _partial_call(body: str) -> ParsedCall:
    """A block still being written: the name once its closing quote is out, the arguments so far."""
    args = _ARGS.search(body)
    name = _NAME.search(body, 0, args.start() if args else len(body))
    try:  # a name with an escape JSON does not know ("a\\q") is not a name yet
        name_text = json.loads(f'"{name.group(1)}"') if name else None
    except ValueError:
        name_text = None
    return ParsedCall(name_text, _raw_arguments(body)[0] if args else "", False)


def _raw_arguments(body: str) -> tuple[str, bool]:
    """The arguments' JSON text as written, and whether it is whole; while it is not, without a
    tail of closing braces and spaces that may belong to the call object itself."""
    args = _ARGS.search(body)
    if args is None:
        return "", False
    try:
        _, end = _DECODER.raw_decode(body, args.end())
        return body[args.end() : end], True
    except (ValueError, RecursionError):
        return body[args.end() :].rstrip(" \t\r\n}"), False


def final_tool_calls(parsed: ParsedOutput) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls
        if c.complete and c.name is not None
    ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _SentCall:
    id: str
    arguments: int = 0


@dataclass
class ToolCallStream:
    """What one streamed choice has sent: content characters and, per call, its id and arguments."""

    parser: HermesToolParser
    content: int = 0
    calls: list[_SentCall] = field(default_factory=list)

    def update(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The new content and tool call pieces since the last update."""
        parsed = self.parser.parse(text, final)
        content = parsed.content[self.content :]
        self.content = max(self.content, len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self.calls):
                self.calls.append(_SentCall(new_call_id()))
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        id=self.calls[i].id,
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            sent = self.calls[i]
            if len(call.arguments) > sent.arguments:
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        function=DeltaFunctionCall(arguments=call.arguments[sent.arguments :]),
                    )
                )
                sent.arguments = len(call.arguments)
        return content, deltas

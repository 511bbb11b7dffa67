"""Tool calls in model output, in the formats of vLLM's `--tool-call-parser`:

- `hermes` (Qwen 2.5 and 3, Hermes, most fine-tunes): content, then `<tool_call>{"name": ...,
  "arguments": ...}</tool_call>` blocks;
- `qwen3_coder` (Qwen3-Coder): content, then `<tool_call><function=NAME><parameter=KEY>value
  </parameter>...</function></tool_call>` blocks, each value typed by the tool's parameter schema;
- `llama3_json` / `llama4_json` (Llama 3.1-3.3, 4): the whole answer is `{"name": ..., "parameters":
  ...}` objects apart by `;`, perhaps after `<|python_tag|>`;
- `mistral`: content, then `[TOOL_CALLS]` and a JSON list of calls, or (tokenizers v11 on) one
  `[TOOL_CALLS]name{arguments}` (or `name[ARGS]{...}`) per call;
- `phi4_mini_json` (Phi-4-mini): content, then `functools[...]`, a JSON list of calls;
- `granite` (Granite 3.x): the whole answer is a JSON list of calls, perhaps after `<|tool_call|>`
  or `<tool_call>`;
- `pythonic` (Llama 3.2 and 4 with a pythonic template, ToolACE): the whole answer is a Python
  list of calls with literal keyword arguments, `[get_weather(city="Paris"), ...]`.

One parse serves both answers: `parse(text, final=True)` for the whole output, and the same call on
the text so far while streaming, where it returns only what can no longer change (content before a
possible call, a name once it is whole, the arguments up to what could still turn out to close the
call). `ToolCallStream` turns successive parses into OpenAI's `delta.tool_calls` pieces, so the
pieces of a stream add up to the non-streamed answer. Text that does not turn out to be calls of
the format is content, whole.

Each parser also writes calls in its format (`write`), and says how (`instructions`), for a chat
template that knows no tools (server/tools.py).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

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


class NotCalls(Exception):
    """The text is not calls of the format after all: it is content."""


class PlainText(Exception):
    """The answer does not begin as calls: it is content, to be streamed as it comes."""


@dataclass
class ToolParser:
    """A format of tool calls: how they are read from the output, and written for a template that
    knows no tools."""

    max_calls: int | None = None  # 1 when parallel_tool_calls is false: later calls are dropped
    tools: dict[str, dict] = field(default_factory=dict)  # name -> its parameters' properties
    # calls' ids: "call_" and 24 hex digits, or this many letters and digits (Mistral's templates
    # refuse other ids when the calls come back in the history)
    id_length: int | None = None
    name: ClassVar[str]
    instructions: ClassVar[str]  # how to call, told to a model whose template knows no tools
    keeps_special_tokens: ClassVar[bool] = False  # the format's marker is a special token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        try:
            parsed = self._read(text, final)
        except PlainText:
            return ParsedOutput(text)
        except NotCalls:
            return ParsedOutput(text if final else self._before_calls(text))
        if final and not (
            parsed.calls and all(c.complete and c.name is not None for c in parsed.calls)
        ):
            return ParsedOutput(text)
        del parsed.calls[self.max_calls or len(parsed.calls) :]
        return parsed

    def _read(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def _before_calls(self, text: str) -> str:
        """While streaming, the content of text that turned out not to be calls: what came before
        the format's marker (the rest is shown when the output ends)."""
        return ""

    def write(self, calls: list[tuple[str, Any]]) -> str:
        """Calls (name, arguments) as the model writes them."""
        raise NotImplementedError

    def call_id(self) -> str:
        if self.id_length is not None:
            return "".join(random.choices(string.ascii_letters + string.digits, k=self.id_length))
        return f"call_{uuid.uuid4().hex[:24]}"


class MarkedToolParser(ToolParser):
    """A format whose calls may follow text: content up to its marker, calls from there."""

    start: ClassVar[str]

    def _read(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(self.start)
        if at == -1:
            return ParsedOutput(text if final else hold_back(text, self.start))
        return ParsedOutput(text[:at], self._calls(text[at:], final))

    def _calls(self, text: str, final: bool) -> list[ParsedCall]:
        """The calls of text from the marker on."""
        raise NotImplementedError

    def _before_calls(self, text: str) -> str:
        return text[: text.find(self.start)]


class TagBlockToolParser(MarkedToolParser):
    """Calls in `<tool_call>` ... `</tool_call>` blocks, one a block."""

    start = "<tool_call>"
    end = "</tool_call>"

    def _calls(self, text: str, final: bool) -> list[ParsedCall]:
        calls = []
        for block in text.split(self.start)[1:]:
            body, closed = block.split(self.end, 1)[0], self.end in block
            calls.append(self._block(body, closed or final))
        return calls

    def _block(self, body: str, complete: bool) -> ParsedCall:
        raise NotImplementedError


class HermesToolParser(TagBlockToolParser):
    name = "hermes"
    instructions = (
        "For each function call, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )

    def _block(self, body: str, complete: bool) -> ParsedCall:
        return _object_call(body, complete)

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in calls
        )


class Qwen3CoderToolParser(TagBlockToolParser):
    name = "qwen3_coder"
    instructions = (
        "For each function call, write its name and each parameter's value within tags:\n"
        "<tool_call>\n<function=function-name>\n<parameter=parameter-name>\nvalue\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    _FUNCTION = re.compile(r"<function=([^>\n]+)>")
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>")

    def _block(self, body: str, complete: bool) -> ParsedCall:
        """While the block is not complete: its name once its tag is whole, and the parameters
        whose closing tag is out (their JSON text only grows)."""
        body = body.lstrip()
        fn = self._FUNCTION.match(body)
        if fn is None:
            if not complete and _may_open(body, "<function="):
                return ParsedCall(None, "", False)
            raise NotCalls
        name = fn.group(1).strip()
        schema = self.tools.get(name)
        schema = schema if isinstance(schema, dict) else {}  # (a request's properties may be odd)
        entries: list[str] = []
        at = fn.end()
        while True:
            rest = body[at:].lstrip()
            if rest.startswith("</function>"):
                tail = rest[len("</function>") :].strip()  # (a block's end may be on its way)
                if tail and (complete or not self.end.startswith(tail)):
                    raise NotCalls
                return ParsedCall(name, "{" + ", ".join(entries) + "}", complete)
            param = self._PARAMETER.match(rest)
            if param is None:
                if complete and not rest:  # the output ended before </function>
                    return ParsedCall(name, "{" + ", ".join(entries) + "}", True)
                if complete or not (
                    _may_open(rest, "<parameter=") or "</function>".startswith(rest)
                ):
                    raise NotCalls
                return ParsedCall(name, "{" + ", ".join(entries), False)
            close = rest.find("</parameter>", param.end())
            if close == -1 and not complete:
                return ParsedCall(name, "{" + ", ".join(entries), False)
            value = rest[param.end() : close if close != -1 else len(rest)]
            value = value.removeprefix("\n").removesuffix("\n")
            key = param.group(1).strip()
            typed = _typed(value, schema.get(key))
            entries.append(f"{json.dumps(key)}: {json.dumps(typed, ensure_ascii=False)}")
            at = len(body) - len(rest) + (close + len("</parameter>") if close != -1 else len(rest))

    def write(self, calls: list[tuple[str, Any]]) -> str:
        def value(v: Any) -> str:
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        return "".join(
            f"<tool_call>\n<function={n}>\n"
            + "".join(
                f"<parameter={k}>\n{value(v)}\n</parameter>\n"
                for k, v in (a.items() if isinstance(a, dict) else ())
            )
            + "</function>\n</tool_call>"
            for n, a in calls
        )


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    instructions = (
        "To call functions, answer with nothing but one JSON object per call, separated by "
        '"; ": {"name": <function-name>, "parameters": <args-json-object>}'
    )

    def _read(self, text: str, final: bool) -> ParsedOutput:
        at = _after_marker(text, (self.tag,), final)
        if at is None:
            return ParsedOutput("")
        bodies, _ = _objects(text, at, ";", None)
        return ParsedOutput("", [_object_call(b, whole or final) for b, whole in bodies])

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


class GraniteToolParser(ToolParser):
    name = "granite"
    markers = ("<|tool_call|>", "<tool_call>")  # Granite 3.0's token, 3.1's text
    instructions = (
        "To call functions, answer with nothing but <tool_call> and a JSON list of calls: "
        '<tool_call>[{"name": <function-name>, "arguments": <args-json-object>}]'
    )

    def _read(self, text: str, final: bool) -> ParsedOutput:
        at = _after_marker(text, self.markers, final, opener="[")
        if at is None:
            return ParsedOutput("")
        return ParsedOutput("", _list_calls(text, at + 1, final))

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "<tool_call>" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


@dataclass
class MistralToolParser(MarkedToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    args_tag = "[ARGS]"
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token, gone from text decoded without
    instructions = (
        "To call functions, write [TOOL_CALLS] and a JSON list of calls: "
        '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    )
    _FN = re.compile(r"\s*([A-Za-z0-9_.\-]+)")

    def _calls(self, text: str, final: bool) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for piece in text.split(self.start)[1:]:
            head = piece.lstrip()
            if head.startswith("["):  # a list of call objects
                calls += _list_calls(piece, len(piece) - len(head) + 1, final)
            elif head or final:
                calls.append(self._named_call(piece, final))
        return calls

    def _named_call(self, piece: str, final: bool) -> ParsedCall:
        """`name{...}` or `name[ARGS]{...}` (tokenizers v11 and v13)."""
        fn = self._FN.match(piece)
        if fn is None:
            raise NotCalls
        rest = piece[fn.end() :].lstrip()
        if rest.startswith(self.args_tag):
            rest = rest[len(self.args_tag) :].lstrip()
        elif not final and self.args_tag.startswith(rest):
            return ParsedCall(None, "", False)  # the name may go on, or [ARGS] be on its way
        if not rest.startswith("{"):
            if rest or final:
                raise NotCalls
            return ParsedCall(None, "", False)
        args, whole = _raw_json(rest, 0)
        if whole and rest[len(args) :].strip():
            raise NotCalls
        return ParsedCall(fn.group(1), args, whole)

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return self.start + json.dumps([{"name": n, "arguments": a} for n, a in calls])

    id_length: int | None = 9


class Phi4MiniJsonToolParser(MarkedToolParser):
    name = "phi4_mini_json"
    start = "functools["
    instructions = (
        "To call functions, write functools and a JSON list of calls: "
        'functools[{"name": <function-name>, "arguments": <args-json-object>}]'
    )

    def _calls(self, text: str, final: bool) -> list[ParsedCall]:
        return _list_calls(text, len(self.start), final)

    def write(self, calls: list[tuple[str, Any]]) -> str:
        return "functools" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


class PythonicToolParser(ToolParser):
    name = "pythonic"
    instructions = (
        "To call functions, answer with nothing but a Python list of calls with keyword "
        'arguments: [func_name1(param1="value1", param2=2), func_name2(param="value")]'
    )
    _CALLEE = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")

    def _read(self, text: str, final: bool) -> ParsedOutput:
        at = _after_marker(text, (), final, opener="[")
        if at is None:
            return ParsedOutput("")
        items, closed = _python_items(text, at + 1)
        if final and not closed:
            raise NotCalls
        calls = []
        for item, whole in items:
            if whole:
                calls.append(_python_call(item))
                continue
            callee = self._CALLEE.match(item)  # a name is whole once its "(" is out
            calls.append(ParsedCall(callee.group(1) if callee else None, "", False))
        return ParsedOutput("", calls)

    def write(self, calls: list[tuple[str, Any]]) -> str:
        def call(name: str, args: Any) -> str:
            kw = args.items() if isinstance(args, dict) else ()
            return f"{name}({', '.join(f'{k}={_python_literal(v)}' for k, v in kw)})"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "granite": GraniteToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
}


def tool_parser(
    name: str, max_calls: int | None = None, tools: dict[str, dict] | None = None
) -> ToolParser:
    """`tools`: each tool's parameter properties by its name (qwen3_coder types values by them)."""
    return PARSERS[name](max_calls=max_calls, tools=tools or {})


# ---------------------------------------------------------------- reading the formats


def _after_marker(
    text: str, markers: tuple[str, ...], final: bool, opener: str = "{"
) -> int | None:
    """For a format whose calls are the whole answer: where the first call's `opener` is, past
    leading space and an optional marker; None while the start is still undecided (streaming)."""
    at = len(text) - len(text.lstrip())
    marked = False
    for marker in markers:
        if text.startswith(marker, at):
            at += len(marker)
            at += len(text[at:]) - len(text[at:].lstrip())
            marked = True
            break
        if not final and marker.startswith(text[at:]):
            return None
    if at == len(text) and not final:
        return None
    if not text.startswith(opener, at):
        raise NotCalls if marked else PlainText
    return at


def _objects(text: str, at: int, sep: str, close: str | None) -> tuple[list[tuple[str, bool]], int]:
    """The JSON objects from text[at], apart by space and `sep`, up to `close` (None: the end), each
    as its text and whether it is whole; and where the run ends (after `close`, else len(text)).
    An unfinished object ends the run: the output ends there or it will go on."""
    bodies: list[tuple[str, bool]] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == sep):
            at += 1
        if at == len(text):
            return bodies, at
        if text[at] == close:
            return bodies, at + 1
        if text[at] != "{":
            raise NotCalls
        body, whole = _raw_json(text, at)
        bodies.append((body, whole))
        if not whole:
            return bodies, len(text)
        at += len(body)


def _list_calls(text: str, at: int, final: bool) -> list[ParsedCall]:
    """A JSON list of call objects whose "[" ends at `at`; nothing may follow its "]"."""
    bodies, end = _objects(text, at, ",", "]")
    if text[end:].strip() or (final and text[end - 1 : end] != "]"):
        raise NotCalls
    return [_object_call(b, whole or final) for b, whole in bodies]


def _raw_json(text: str, at: int) -> tuple[str, bool]:
    """The JSON value at text[at] as written, and whether it is whole; while it is not, without a
    tail of closing braces and spaces that may belong to the call around it."""
    try:
        _, end = _DECODER.raw_decode(text, at)
        return text[at:end], True
    except (ValueError, RecursionError):  # unfinished, bad, or nested deeper than Python parses
        return text[at:].rstrip(" \t\r\n}"), False


def _object_call(body: str, complete: bool) -> ParsedCall:
    return _complete_call(body) if complete else _partial_call(body)


def _complete_call(body: str) -> ParsedCall:
    """A whole call object: its JSON decides; the arguments keep the model's own text when it is
    that JSON (so they equal what was streamed), else they are re-serialized."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise NotCalls from None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        raise NotCalls
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments sent as a JSON string: its content
        return ParsedCall(obj["name"], args, True)
    at = _ARGS.search(body)
    raw, whole = _raw_json(body, at.end()) if at else ("", False)
    if not (whole and json.loads(raw) == args):
        raw = json.dumps(args, ensure_ascii=False)
    return ParsedCall(obj["name"], raw, True)


def _partial_call(body: str) -> ParsedCall:
    """A call object still being written: the name once its closing quote is out, the arguments
    so far."""
    args = _ARGS.search(body)
    name = _NAME.search(body, 0, args.start() if args else len(body))
    try:  # a name with an escape JSON does not know ("a\\q") is not a name yet
        name_text = json.loads(f'"{name.group(1)}"') if name else None
    except ValueError:
        name_text = None
    return ParsedCall(name_text, _raw_json(body, args.end())[0] if args else "", False)


def _python_items(text: str, at: int) -> tuple[list[tuple[str, bool]], bool]:
    """The items of a Python list whose "[" ends at `at`, each as its text and whether it is whole,
    and whether the list is closed (then nothing but space may follow)."""
    items: list[tuple[str, bool]] = []
    depth, quote, start, i = 0, "", at, at
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                if ch != "]":
                    raise NotCalls
                if text[start:i].strip():
                    items.append((text[start:i], True))
                if text[i + 1 :].strip():
                    raise NotCalls
                return items, True
            depth -= 1
        elif ch == "," and depth == 0:
            items.append((text[start:i], True))
            start = i + 1
        i += 1
    if text[start:].strip():
        items.append((text[start:], False))
    return items, False


def _python_call(src: str) -> ParsedCall:
    """`name(key=literal, ...)` as a call with JSON arguments."""
    try:
        node = ast.parse(src.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise NotCalls from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise NotCalls
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(args) != len(node.keywords):  # a **spread
            raise NotCalls
        return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False), True)
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not literals, or not JSON's
        raise NotCalls from None


def _may_open(text: str, tag: str) -> bool:
    """Whether text may still become `tag` and what follows it on its line (streaming)."""
    return tag.startswith(text) or (text.startswith(tag) and "\n" not in text and ">" not in text)


def _typed(value: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the value its schema's type says (as vLLM reads them):
    text that is not of that type stays text, and "null" is null."""
    if value.lower() == "null":
        return None
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    kinds = {str(k).lower() for k in (kind if isinstance(kind, list) else [kind])}
    if kinds & {"string", "null"} == kinds or "string" in kinds:
        return value
    try:
        if kinds <= {"integer"}:
            return int(value)
        if kinds <= {"number", "integer"}:
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
        if kinds <= {"boolean"}:
            return {"true": True, "false": False}.get(value.strip().lower(), value)
        try:
            return json.loads(value)
        except ValueError:
            literal = ast.literal_eval(value)
            json.dumps(literal, allow_nan=False)  # only what JSON can hold
            return literal
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return value


def _python_literal(value: Any) -> str:
    """A JSON value as a Python literal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_python_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    return repr(value)


# ---------------------------------------------------------------- the answer


def final_tool_calls(parsed: ParsedOutput, parser: ToolParser) -> list[ToolCall]:
    return [
        ToolCall(id=parser.call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls
        if c.complete and c.name is not None
    ]


@dataclass
class _SentCall:
    id: str
    arguments: int = 0


@dataclass
class ToolCallStream:
    """What one streamed choice has sent: content characters and, per call, its id and arguments."""

    parser: ToolParser
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
                self.calls.append(_SentCall(self.parser.call_id()))
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

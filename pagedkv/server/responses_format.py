"""/v1/responses bodies: a Response object, and its stream of typed events.

The answer is a chat answer (ChatFormat splits the reasoning from the text and reads tool calls):
output items are a `reasoning` item (with a reasoning parser, when the model thought), a `message`
item with one `output_text` part (unless the model only called functions), and a `function_call`
item per call. A stream sends response.created and response.in_progress, then per item
output_item.added, its deltas and its .done events, and ends with response.completed (or
response.incomplete when max_output_tokens cut it) carrying the whole Response, usage included.
Events carry `sequence_number`s and go out as SSE with their type as the event name; no [DONE].
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, RootModel

from pagedkv.engine.outputs import RequestOutput
from pagedkv.server import responses as api
from pagedkv.server.chat_format import ChatFormat
from pagedkv.server.response_format import Delta, usage_of
from pagedkv.server.response_store import EventLog
from pagedkv.server.tool_parsers import ParsedCall, ToolCallStream


class Events(BaseModel):
    """Stream events to send in order (one ResponseFormat chunk may make several)."""

    events: list[dict[str, Any]]


def usage_json(usage: api.Usage, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def _text(item: dict) -> str:
    """What an item has said so far: its text, or a call's arguments."""
    return item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]


@dataclass
class ResponsesFormat(ChatFormat):
    settings: dict[str, Any] = field(default_factory=dict)  # the request's, as Responses show them
    count_tokens: Any = None  # text -> its token count (reasoning_tokens)
    keep: Callable[[dict], None] | None = None  # stores the finished Response (None: not kept)
    background: bool = False  # answered at once as queued; kept as it ends (serving.py)
    status: str = "queued"  # a background Response's, as last kept
    events: EventLog | None = None  # a streamed background Response's stream, kept
    done_marker = None
    _seq: int = 0
    _items: list[dict] = field(default_factory=list)  # output items streamed so far, in order
    _calls: ToolCallStream | None = None  # the stream's tool calls, with a tool parser
    _opened: bool = False  # response.created and .in_progress sent (before the first output)

    # ---- items --------------------------------------------------------------------------

    def _item(self, kind: str, status: str, text: str = "", call: Any = None) -> dict:
        suffix = self.id.removeprefix("resp_")
        if kind == "reasoning":
            return {
                "id": f"rs_{suffix}",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
                "status": status,
            }
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return {
                "id": f"msg_{suffix}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [part],
            }
        index = sum(i["type"] == "function_call" for i in self._items) if call is None else call
        return {
            "id": f"fc_{suffix}_{index}",
            "type": "function_call",
            "status": status,
            "arguments": text,
        }

    def _body(
        self, status: str, output: list[dict], usage: dict | None, reason: str | None
    ) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            "store": self.keep is not None,
            "background": self.background,
            "previous_response_id": None,
            "reasoning": None,
            "truncation": "disabled",
            **self.settings,
        }

    def _calls_in(self, text: str, cut: bool) -> tuple[str, list[ParsedCall]]:
        """The answer's text (before any call) and its calls, as the stream sent them."""
        if self.parser is None:
            return text, []
        parsed = self.parser.parse(text, final=self._final(text, cut))
        return parsed.content, [c for c in parsed.calls if c.name is not None]

    def _final(self, text: str, cut: bool) -> bool:
        """Whether finished output parses as final: not where max_output_tokens cut a call, which
        then stays a call (incomplete), as it was streamed, rather than turning into text."""
        return not (cut and self.parser is not None and self.parser.parse(text, False).calls)

    def _answer(self, finals: list[RequestOutput]) -> dict:
        o = finals[0].outputs[0]
        cut = o.finish_reason == "length"
        status = self.status = "incomplete" if cut else "completed"
        reasoning, text = self._split(o.text, final=True)
        content, calls = self._calls_in(text, cut)
        output = [self._item("reasoning", "completed", reasoning)] if reasoning else []
        if content or not (reasoning or calls):
            output.append(self._item("message", status, content))
        streamed = self._calls.calls if self._calls else []
        for i, call in enumerate(calls):
            assert self.parser is not None  # (calls come from it)
            done = "completed" if call.complete else "incomplete"
            item = self._item("function_call", done, call.arguments, call=i)
            call_id = streamed[i].id if i < len(streamed) else self.parser.call_id()  # as streamed
            output.append({**item, "call_id": call_id, "name": call.name})
        # the tokens spent thinking, shown or not (include_reasoning)
        thought = self.thinking.split(o.text, True)[0] if self.thinking else ""
        counted = self.count_tokens(thought) if thought and self.count_tokens else 0
        usage = usage_json(usage_of(finals), counted)
        body = self._body(status, output, usage, "max_output_tokens" if cut else None)
        if self.keep is not None:
            self.keep(body)
        return body

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        return _Raw(self._answer(finals))

    def left(self, status: str, error: dict | None = None) -> dict:
        """A background Response without its answer, kept: queued, in progress, cancelled or
        failed."""
        self.status = status
        body = {**self._body(status, [], None, None), "error": error}
        if self.keep is not None:
            self.keep(body)
        return body

    # ---- the stream ---------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def frame(self, payload: BaseModel) -> str:
        if not isinstance(payload, Events):  # an error body: the SDKs read it without a name
            return super().frame(payload)
        return "".join(
            f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"
            for e in payload.events
        )

    def start(self, num_choices: int, first: RequestOutput | None) -> list[BaseModel]:
        if self._opened:  # (sent already, by waiting)
            return []
        self._opened = True
        shell = self._body("in_progress", [], None, None)
        created = self._body("queued", [], None, None) if self.background else shell
        created = self._event("response.created", response=created)
        return [Events(events=[created, self._event("response.in_progress", response=shell)])]

    def waiting(self) -> list[str]:
        """The opening events, which need no output: the client learns the Response's id."""
        return [self.frame(opening) for opening in self.start(0, None)]

    def _where(self, item: dict) -> dict:
        where = {"item_id": item["id"], "output_index": self._items.index(item)}
        return where if item["type"] == "function_call" else {**where, "content_index": 0}

    def _open(self, kind: str, **call: str) -> list[dict]:
        item = {**self._item(kind, "in_progress"), **call}
        self._items.append(item)
        shown = {**item, "content": []} if "content" in item else dict(item)
        events = [
            self._event("response.output_item.added", output_index=len(self._items) - 1, item=shown)
        ]
        if kind == "message":
            part = dict(item["content"][0])
            events.append(
                self._event("response.content_part.added", **self._where(item), part=part)
            )
        return events

    def _grow(self, item: dict, new: str) -> dict:
        kind = {
            "reasoning": "response.reasoning_text.delta",
            "message": "response.output_text.delta",
            "function_call": "response.function_call_arguments.delta",
        }[item["type"]]
        if item["type"] == "function_call":
            item["arguments"] += new
        else:
            item["content"][0]["text"] += new
        extra: dict = {"logprobs": []} if item["type"] == "message" else {}
        return self._event(kind, **self._where(item), delta=new, **extra)

    def _close(self, item: dict, status: str) -> list[dict]:
        item["status"] = status if item["type"] != "reasoning" else "completed"
        where, text = self._where(item), _text(item)
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, text=text)]
        elif item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=text)]
        else:
            part = item["content"][0]
            events = [
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
            ]
        index = self._items.index(item)
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _last_open(self, kind: str) -> dict | None:
        for item in self._items:
            if item["type"] == kind and item["status"] == "in_progress":
                return item
        return None

    def _say(self, kind: str, new: str) -> list[dict]:
        """`new` text for the item of `kind`, opened (closing the reasoning) if it is not yet."""
        events: list[dict] = []
        item = self._last_open(kind)
        if item is None:
            if kind == "message" and (thinking := self._last_open("reasoning")) is not None:
                events += self._close(thinking, "completed")
            events += self._open(kind)
            item = self._items[-1]
        return events + ([self._grow(item, new)] if new else [])

    def chunk(self, d: Delta) -> BaseModel | None:
        reasoning, content = self._split(d.output.text, d.finished)
        events: list[dict] = []
        thought = next((i for i in self._items if i["type"] == "reasoning"), None)
        if new := reasoning[len(_text(thought)) if thought else 0 :]:
            events += self._say("reasoning", new)
        cut = d.output.finish_reason == "length"
        if self.parser is not None:
            self._calls = self._calls or ToolCallStream(self.parser)
            text, pieces = self._calls.update(content, d.finished and self._final(content, cut))
        else:
            message = next((i for i in self._items if i["type"] == "message"), None)
            text, pieces = content[len(_text(message)) if message else 0 :], []
        if text:
            events += self._say("message", text)
        for piece in pieces:
            if piece.id is not None:  # a call's first piece: its id and name
                if (thinking := self._last_open("reasoning")) is not None:
                    events += self._close(thinking, "completed")
                events += self._open(
                    "function_call", call_id=piece.id, name=piece.function.name or ""
                )
            if piece.function.arguments:
                opened = [i for i in self._items if i["type"] == "function_call"]
                events.append(self._grow(opened[piece.index], piece.function.arguments))
        if d.finished:
            if not any(i["type"] != "reasoning" for i in self._items) and not reasoning:
                events += self._say("message", "")  # an empty answer is still a message
            parsed = self._calls_in(content, cut)[1]
            for item in [i for i in self._items if i["status"] == "in_progress"]:
                if item["type"] == "function_call":
                    index = int(item["id"].rsplit("_", 1)[1])
                    whole = index < len(parsed) and parsed[index].complete
                    events += self._close(item, "completed" if whole else "incomplete")
                else:
                    events += self._close(item, "incomplete" if cut else "completed")
        return Events(events=events) if events else None

    def closing(self, finals: list[RequestOutput], include_usage: bool) -> list[BaseModel]:
        body = self._answer(finals)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [Events(events=[self._event(kind, response=body)])]

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        """Never sent: `closing` sends the usage inside response.completed."""
        raise NotImplementedError("a Response stream has no usage chunk")


class _Raw(RootModel[dict[str, Any]]):
    """A body already in its JSON shape."""

"""/v1/responses bodies: a Response object, and its stream of typed events.

The answer is a chat answer (ChatFormat splits the reasoning from the text): output items are a
`reasoning` item (with a reasoning parser, when the model thought) and a `message` item with one
`output_text` part. A stream sends response.created and response.in_progress, then per item
output_item.added, its deltas and its .done events, and ends with response.completed (or
response.incomplete when max_output_tokens cut it) carrying the whole Response, usage included.
Events carry `sequence_number`s and go out as SSE with their type as the event name; no [DONE].
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from pagedkv.engine.outputs import RequestOutput
from pagedkv.server import responses as api
from pagedkv.server.chat_format import ChatFormat
from pagedkv.server.response_format import Delta, usage_of


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


@dataclass
class ResponsesFormat(ChatFormat):
    settings: dict[str, Any] = field(
        default_factory=dict
    )  # the request's, as a Response shows them
    count_tokens: Any = None  # text -> its token count (reasoning_tokens)
    done_marker = None
    _seq: int = 0
    _items: list[dict] = field(default_factory=list)  # output items opened so far, in order
    _sent: dict[str, int] = field(default_factory=dict)  # characters streamed, by item type

    def _ids(self) -> dict[str, str]:
        suffix = self.id.removeprefix("resp_")
        return {"reasoning": f"rs_{suffix}", "message": f"msg_{suffix}"}

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

    # ---- the Response object -------------------------------------------------------------

    def _item(self, kind: str, text: str, status: str) -> dict:
        item_id = self._ids()[kind]
        if kind == "reasoning":
            return {
                "id": item_id,
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
                "status": status,
            }
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
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
            "store": False,
            "background": False,
            "previous_response_id": None,
            "reasoning": None,
            "tools": [],
            "truncation": "disabled",
            **self.settings,
        }

    def _answer(self, finals: list[RequestOutput]) -> dict:
        o = finals[0].outputs[0]
        reasoning, content = self._split(o.text, final=True)
        cut = o.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        output = [self._item("reasoning", reasoning, "completed")] if reasoning else []
        if content or not reasoning:
            output.append(self._item("message", content, status))
        counted = self.count_tokens(reasoning) if reasoning and self.count_tokens else 0
        usage = usage_json(usage_of(finals), counted)
        return self._body(status, output, usage, "max_output_tokens" if cut else None)

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        return _Raw.model_validate({"body": self._answer(finals)})

    # ---- the stream ----------------------------------------------------------------------

    def start(self, num_choices: int, first: RequestOutput) -> list[BaseModel]:
        shell = self._body("in_progress", [], None, None)
        return [
            Events(
                events=[
                    self._event("response.created", response=shell),
                    self._event("response.in_progress", response=shell),
                ]
            )
        ]

    def _open(self, kind: str) -> list[dict]:
        index = len(self._items)
        item = self._item(kind, "", "in_progress")
        shown = {**item, "content": []}
        self._items.append(item)
        self._sent[kind] = 0
        events = [self._event("response.output_item.added", output_index=index, item=shown)]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _close(self, item: dict, status: str) -> list[dict]:
        index = self._items.index(item)
        text = item["content"][0]["text"]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        item["status"] = status if item["type"] == "message" else "completed"
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, text=text)]
        else:
            part = item["content"][0]
            events = [
                self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
            ]
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _open_item(self, kind: str) -> dict | None:
        return next(
            (i for i in self._items if i["type"] == kind and i["status"] == "in_progress"), None
        )

    def chunk(self, d: Delta) -> BaseModel | None:
        reasoning, content = self._split(d.output.text, d.finished)
        events: list[dict] = []
        new = reasoning[self._sent.get("reasoning", 0) :] if reasoning else ""
        if new:
            if self._open_item("reasoning") is None:
                events += self._open("reasoning")
            item = self._open_item("reasoning")
            assert item is not None
            item["content"][0]["text"] = reasoning
            self._sent["reasoning"] = len(reasoning)
            where = {"item_id": item["id"], "output_index": self._items.index(item)}
            events.append(
                self._event("response.reasoning_text.delta", **where, content_index=0, delta=new)
            )
        wants_message = bool(content) or (d.finished and not reasoning)
        if wants_message:
            if (open_reasoning := self._open_item("reasoning")) is not None:
                events += self._close(open_reasoning, "completed")
            if not any(i["type"] == "message" for i in self._items):
                events += self._open("message")
            item = self._open_item("message")
            new = content[self._sent.get("message", 0) :]
            if item is not None and new:
                item["content"][0]["text"] = content
                self._sent["message"] = len(content)
                where = {
                    "item_id": item["id"],
                    "output_index": self._items.index(item),
                    "content_index": 0,
                }
                events.append(
                    self._event("response.output_text.delta", **where, delta=new, logprobs=[])
                )
        if d.finished:
            status = "incomplete" if d.output.finish_reason == "length" else "completed"
            for item in [i for i in self._items if i["status"] == "in_progress"]:
                events += self._close(item, status)
        return Events(events=events) if events else None

    def closing(self, finals: list[RequestOutput], include_usage: bool) -> list[BaseModel]:
        body = self._answer(finals)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [Events(events=[self._event(kind, response=body)])]

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        """Never sent: `closing` sends the usage inside response.completed."""
        raise NotImplementedError("a Response stream has no usage chunk")


class _Raw(BaseModel):
    """A body already in its JSON shape."""

    body: dict[str, Any]

    def model_dump_json(self, **kwargs: Any) -> str:
        return json.dumps(self.body, ensure_ascii=False)

"""/v1/chat/completions bodies: assistant messages, reasoning, tool calls, and chat logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from pagedkv.engine.outputs import CompletionOutput, RequestOutput, SampleLogprob
from pagedkv.engine.reasoning import ReasoningSplit
from pagedkv.server import responses as api
from pagedkv.server.response_format import (
    MIN_LOGPROB,
    Delta,
    ResponseFormat,
    prompt_logprobs_json,
    usage_of,
)
from pagedkv.server.tool_parsers import ToolCallStream, ToolParser, final_tool_calls


@dataclass
class _Sent:
    """What one streamed choice has sent of its reasoning and content."""

    tools: ToolCallStream | None
    reasoning: int = 0
    content: int = 0


@dataclass
class ChatFormat(ResponseFormat):
    parser: ToolParser | None = None  # tool calls are read from the output
    role: str = "assistant"  # the answer's
    echo: str = ""  # the last message, when the client asked to echo it
    # with a reasoning parser: its marks and where the output begins (engine/reasoning.py), and
    # whether the client gets the reasoning (include_reasoning)
    thinking: ReasoningSplit | None = None
    include_reasoning: bool = True
    prompt_text: str | None = None  # the templated prompt, for return_prompt_text
    streams: dict[int, _Sent] = field(default_factory=dict)

    def logprobs(self, items: list[SampleLogprob] | None) -> api.ChatLogprobs | None:
        if items is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {
                "token": text,
                "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(text.encode()),
            }

        return api.ChatLogprobs(
            content=[
                api.ChatTokenLogprob(
                    **entry(lp.token_id, lp.logprob),
                    top_logprobs=[api.TopLogprob(**entry(t, v)) for t, v in lp.top.items()],
                )
                for lp in items
            ]
        )

    def _chunk(
        self,
        choices: list[api.ChatChunkChoice],
        usage: api.Usage | None = None,
        prompt_token_ids: list[int] | None = None,
        prompt_text: str | None = None,
    ) -> BaseModel:
        return api.ChatCompletionChunk(
            id=self.id,
            model=self.model,
            created=self.created,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
            prompt_text=prompt_text,
        )

    def start(self, num_choices: int, first: RequestOutput) -> list[BaseModel]:
        delta = api.ChatDelta(role=self.role, content=self.echo)
        prompt = self.ids(first.prompt_token_ids)
        return [
            self._chunk(
                [api.ChatChunkChoice(index=i, delta=delta)],
                prompt_token_ids=prompt,
                prompt_text=self.prompt_text,
            )
            for i in range(num_choices)
        ]

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far; no reasoning without a reasoning parser."""
        if self.thinking is None:
            return "", text
        reasoning, content = self.thinking.split(text, final)
        return (reasoning if self.include_reasoning else ""), content

    def chunk(self, d: Delta) -> BaseModel | None:
        text, reasoning, calls = d.text, "", None
        finish = d.output.finish_reason if d.finished else None
        if self.parser is not None or self.thinking is not None:
            sent = self.streams.setdefault(
                d.index, _Sent(ToolCallStream(self.parser) if self.parser else None)
            )
            reasoning, content = self._split(d.output.text, d.finished)
            reasoning, sent.reasoning = reasoning[sent.reasoning :], len(reasoning)
            if sent.tools is not None:
                text, calls = sent.tools.update(content, d.finished)
                if sent.tools.calls and finish == "stop":
                    finish = "tool_calls"
            else:
                text, sent.content = content[sent.content :], len(content)
            if not (text or reasoning or calls or d.logprobs or d.finished):
                return None  # nothing the client can use yet (a tag or tool call being written)
        return self._chunk(
            [
                api.ChatChunkChoice(
                    index=d.index,
                    delta=api.ChatDelta(
                        reasoning=reasoning or None, content=text or None, tool_calls=calls or None
                    ),
                    logprobs=self.logprobs(d.logprobs),
                    finish_reason=finish,
                    stop_reason=d.output.stop_reason if d.finished else None,
                    token_ids=self.ids(d.token_ids),
                )
            ]
        )

    def message(self, o: CompletionOutput) -> tuple[api.ChatResponseMessage, str | None]:
        """The answer's message and finish reason: reasoning and tool calls, when the output has
        them."""
        reasoning, text = self._split(o.text, final=True)
        reasoning_or_none = reasoning or None
        if self.parser is not None:
            parsed = self.parser.parse(text, final=True)
            calls = final_tool_calls(parsed, self.parser)
            if calls:
                content = self.echo + parsed.content
                finish = "tool_calls" if o.finish_reason == "stop" else o.finish_reason
                message = api.ChatResponseMessage(
                    role=self.role,
                    content=content if content.strip() else None,
                    reasoning=reasoning_or_none,
                    tool_calls=calls,
                )
                return message, finish
        content = self.echo + text
        message = api.ChatResponseMessage(
            role=self.role,
            # with a reasoning parser, as vLLM: no content when it only thought (max_tokens)
            content=content if content or self.thinking is None else None,
            reasoning=reasoning_or_none,
        )
        return message, o.finish_reason

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        final = finals[0]  # a chat request is one prompt: its choices keep their own index
        out = []
        for o in final.outputs:
            message, finish = self.message(o)
            out.append(
                api.ChatChoice(
                    index=o.index,
                    message=message,
                    logprobs=self.logprobs(o.sample_logprobs),
                    finish_reason=finish,
                    stop_reason=o.stop_reason,
                    token_ids=self.ids(o.token_ids),
                )
            )
        return api.ChatCompletionResponse(
            id=self.id,
            model=self.model,
            created=self.created,
            usage=usage_of(finals),
            choices=out,
            prompt_logprobs=prompt_logprobs_json(self.token, final.prompt_logprobs),
            prompt_token_ids=self.ids(final.prompt_token_ids),
            prompt_text=self.prompt_text,
        )

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        return self._chunk([], usage)

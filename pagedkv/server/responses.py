"""The OpenAI wire format's responses: completions, chat completions, stream chunks, models.

The requests, and their mapping to SamplingParams, are in protocol.py.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from pagedkv.server.request_fields import DeltaToolCall, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None: the first prompt token under echo
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[int, dict] | None] | None = None
    # return_token_ids: the output's (a stream: those since the last chunk) and the prompt's (a
    # stream: in a choice's first chunk), as vLLM places them
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # --response-role, or the last message's (see serving.chat)
    content: str | None
    reasoning: str | None = None  # --reasoning-parser: the <think> section (vLLM's name)
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[int, dict] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_text: str | None = None  # return_prompt_text


class ChatDelta(BaseModel):
    role: str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler) -> dict:
        """OpenAI leaves out what a delta does not carry (the last one is `{}`)."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # on the last chunk, as in the full response (vLLM's)
    token_ids: list[int] | None = None  # return_token_ids: those since the last chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the role chunks
    prompt_text: str | None = None  # return_prompt_text: in the role chunks

    @model_serializer(mode="wrap")
    def _omit_prompt(self, handler) -> dict:
        """The prompt's fields only in the chunks that carry them (as vLLM sends them)."""
        body = handler(self)
        for name in ("prompt_token_ids", "prompt_text"):
            if body.get(name, 0) is None:
                del body[name]
        return body


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None  # the model's path; an adapter's folder
    parent: str | None = None  # an adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

"""Request and response models of vLLM's utility endpoints: /tokenize, /detokenize, /version.

Validated as strictly as the generation endpoints (protocol.py): a wrong type
is a 400 naming the field, and a tokenize request is either a prompt or a
conversation, never both.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from pagedkv.server.protocol import ChatMessage
from pagedkv.server.request_fields import ToolDefinition
from pagedkv.server.validation import RequestModel, SafeStr


class TokenizeRequest(RequestModel):
    """vLLM's two forms: {"prompt": ...} or {"messages": [...]}.

    Messages are rendered with the chat template."""

    model: str | None = None
    prompt: SafeStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: SafeStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    documents: list[dict] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: SafeStr = Field(min_length=1)
    lora_path: SafeStr = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is accepted: names are the key)."""

    lora_name: SafeStr = Field(min_length=1)
    lora_int_id: int | None = None

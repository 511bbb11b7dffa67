"""Request and response models of vLLM's utility endpoints: /tokenize, /detokenize, /version.

Validated as strictly as the generation endpoints (protocol.py): a wrong type
is a 400 naming the field, and a tokenize request is either a prompt or a
conversation, never both.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from pagedkv.server.protocol import ChatMessage
from pagedkv.server.request_fields import ToolDefinition
from pagedkv.server.validation import RequestModel, SafeStr


class ChatForm(RequestModel):
    """A request that comes as text (its field `text_field`) or as a conversation, rendered with
    the chat template (tools.chat_prompt) by vLLM's fields for it: exactly one of the two."""

    text_field: ClassVar[str]
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for text, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: SafeStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    documents: list[dict] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> ChatForm:
        if (getattr(self, self.text_field) is None) == (self.messages is None):
            raise ValueError(f"give exactly one of {self.text_field} and messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    def special_tokens(self) -> bool:
        """Whether encoding adds the tokenizer's special tokens (a template has its own)."""
        if self.messages is None:
            return self.add_special_tokens is not False
        return bool(self.add_special_tokens)


class TokenizeRequest(ChatForm):
    """vLLM's two forms: {"prompt": ...} or {"messages": [...]}."""

    text_field = "prompt"
    model: str | None = None
    prompt: SafeStr | None = None
    return_token_strs: bool = False


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

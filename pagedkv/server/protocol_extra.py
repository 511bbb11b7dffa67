"""Request and response models of vLLM's utility endpoints: /tokenize, /detokenize, /version.

Validated as strictly as the generation endpoints (protocol.py): a wrong type
is a 400 naming the field, and a tokenize request is either a prompt or a
conversation, never both.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from pagedkv.server.protocol import ChatForm
from pagedkv.server.validation import RequestModel, SafeStr


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


class RegisterAdapterRequest(RequestModel):
    """SageMaker's POST /adapters body (or query): the adapter's name and folder. pagedkv loads
    every adapter when it is registered and keeps it until it is unregistered, which is what
    SageMaker's `preload` and `pin` ask for (both accepted; false changes nothing)."""

    name: SafeStr = Field(min_length=1)
    src: SafeStr = Field(min_length=1)
    preload: bool = True
    pin: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id is accepted: names are the key)."""

    lora_name: SafeStr = Field(min_length=1)
    lora_int_id: int | None = None

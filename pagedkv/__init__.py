"""pagedkv: an LLM inference engine and OpenAI-compatible server built around a paged KV cache."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy, so `pagedkv simulate` and the kv package never import torch.
    if name == "LLM":
        from pagedkv.engine.llm import LLM
        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from pagedkv.engine import request
        return getattr(request, name)
    raise AttributeError(name)

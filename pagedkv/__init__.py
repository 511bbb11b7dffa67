"""pagedkv: an LLM inference engine and OpenAI-compatible server built around a paged KV cache.

The Python API mirrors vLLM's: LLM, SamplingParams, RequestOutput, CompletionOutput,
Logprob, AsyncLLMEngine, AsyncEngineArgs / EngineArgs, TextPrompt, TokensPrompt, LoRARequest,
PoolingParams, EmbeddingRequestOutput (LLM.embed), ClassificationRequestOutput (LLM.classify),
ScoringRequestOutput (LLM.score) and PoolingRequestOutput (LLM.encode, AsyncLLMEngine.encode).
"""

from __future__ import annotations

from typing import TypedDict

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "AsyncLLMEngine",
    "AsyncEngineArgs",
    "EngineArgs",
    "TextPrompt",
    "TokensPrompt",
    "LoRARequest",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "ClassificationRequestOutput",
    "ScoringRequestOutput",
    "PoolingRequestOutput",
]

# module that defines each lazily imported name
_LAZY = {
    "LLM": "pagedkv.engine.llm",
    "SamplingParams": "pagedkv.engine.request",
    "LoRARequest": "pagedkv.engine.request",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "Logprob": "pagedkv.engine.outputs",
    "PoolingParams": "pagedkv.engine.pooling",
    "EmbeddingRequestOutput": "pagedkv.engine.outputs",
    "ClassificationRequestOutput": "pagedkv.engine.outputs",
    "ScoringRequestOutput": "pagedkv.engine.outputs",
    "PoolingRequestOutput": "pagedkv.engine.outputs",
    "AsyncLLMEngine": "pagedkv.engine.async_compat",
    "AsyncEngineArgs": "pagedkv.engine.async_compat",
    "EngineArgs": "pagedkv.engine.async_compat",
}


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


def __getattr__(name: str):
    # Lazy, so `pagedkv simulate` and the kv package never import torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)

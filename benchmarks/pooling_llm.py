"""The LLM a pooling benchmark (bench_embed.py, bench_rerank.py, bench_classify.py) times:
pagedkv's, or vLLM CPU's pooling runner (run with the peer venv's python), both at a 2048-token
context and seed 0, in the dtype given, else pagedkv's `--dtype auto` and vLLM's bfloat16 (what
auto chooses on an AVX-512 BF16 CPU; float32 is vLLM's faster one on AVX2)."""

from __future__ import annotations

from typing import Any


def pooling_llm(engine: str, model: str | None, dtype: str | None = None, **options: Any) -> Any:
    """options: keyword arguments both engines' LLM take alike (enable_prefix_caching,
    hf_overrides)."""
    if engine == "vllm":
        from vllm import LLM as VllmLLM

        return VllmLLM(
            model=model,
            dtype=dtype or "bfloat16",
            max_model_len=2048,
            seed=0,
            runner="pooling",
            **options,
        )
    from pagedkv import LLM

    return LLM(model, dtype=dtype or "auto", max_model_len=2048, seed=0, **options)

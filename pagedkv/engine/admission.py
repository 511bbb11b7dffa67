"""What the engine checks before it takes a request: a prompt it can tokenize, and a request that
can ever run (in the vocabulary, within max_model_len, within what the KV pool holds)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pagedkv.config import ConfigError
from pagedkv.engine.logits_processors import bad_words_token_ids, completing_tokens
from pagedkv.engine.pooling import NO_LM_HEAD
from pagedkv.engine.request import ParamError, SamplingParams, shown, valid_text

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine


def tokenize(tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids: text is encoded, a list of ids is taken as it is."""
    if isinstance(prompt, str):
        if not valid_text(prompt):
            raise ParamError(
                "prompt", "prompt must be valid Unicode text (it holds a lone surrogate)"
            )
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if not isinstance(prompt, (list, tuple)):
        raise ParamError(
            "prompt",
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
        )
    return list(prompt)


def _resolve_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """-1 asks for the whole vocabulary; each count must be within --max-logprobs (as vLLM)."""
    cap = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is None:
            continue
        wanted = vocab_size if asked == -1 else asked
        if wanted > cap:
            raise ParamError(
                name,
                f"{name}={asked} asks for {wanted} logprobs a token; this server gives at most "
                f"{cap} (--max-logprobs {max_logprobs}, a vocabulary of {vocab_size})",
            )
        setattr(params, name, wanted)


def _check_beam_width(width: int, vocab_size: int) -> None:
    """Each step takes every beam's 2n most likely next tokens."""
    if 2 * width > vocab_size:
        raise ParamError(
            "n",
            f"beam search with n={width} takes the {2 * width} most likely tokens a step, more "
            f"than the vocabulary's {vocab_size}",
        )


def validate_request(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams) -> int:
    """Reject what can never run, with the reason; returns max_tokens resolved."""
    params.validate(engine.vocab_size)  # again: offline callers may have changed fields since
    if params.pooling is None and not engine.generates:
        if engine.classifier is not None:
            raise ConfigError(
                f"this engine is a classifier only ({engine.classifier_source()}): /classify, "
                "/score, /rerank, LLM.classify, LLM.score"
            )
        why = "--runner pooling" if engine.config.runner == "pooling" else NO_LM_HEAD
        raise ConfigError(
            f"this engine makes embeddings only ({why}): /v1/embeddings, /score, /rerank, "
            "LLM.embed, LLM.score"
        )
    if params.pooling is not None:
        engine.check_pools()
    if params.priority != 0 and engine.config.scheduling_policy != "priority":
        raise ParamError(
            "priority",
            "priority needs an engine started with --scheduling-policy priority "
            '(scheduling_policy="priority" offline)',
        )
    _resolve_logprobs(params, engine.config.max_logprobs, engine.vocab_size)
    cap = engine.config.max_logprobs
    if params.logprob_token_ids and cap != -1 and len(params.logprob_token_ids) > cap:
        raise ParamError(
            "logprob_token_ids",
            f"logprob_token_ids asks for {len(params.logprob_token_ids)} logprobs a token; this "
            f"server gives at most {cap} (--max-logprobs)",
        )
    if params.use_beam_search:
        _check_beam_width(params.n, engine.vocab_size)
    if params.lora_name is not None and params.lora_name not in engine.loras:
        raise ParamError("model", f"no LoRA adapter {params.lora_name!r} is loaded")
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise ParamError("prompt", "the prompt is empty")
    bad = [t for t in prompt_ids if type(t) is not int or not 0 <= t < engine.vocab_size]
    if bad:
        raise ParamError(
            "prompt",
            f"token id {shown(bad[0])} is outside the vocabulary [0, {engine.vocab_size})",
        )
    if params.structured_outputs is not None:
        engine.structured.compile(params.structured_outputs)  # cached: the server compiled it
    if params.thinking_token_budget is not None and engine.thinking is None:
        raise ParamError(
            "thinking_token_budget",
            "thinking_token_budget needs an engine started with --reasoning-parser "
            "deepseek_r1, qwen3 or mistral (reasoning_parser= offline)"
            + (": granite's marks are phrases, not tokens" if engine.reasoning else ""),
        )
    if params.bad_words and not params.bad_words_token_ids:
        params.bad_words_token_ids = bad_words_token_ids(engine.tokenizer, params.bad_words)
    _check_first_token_allowed(params, engine.tokenizer.eos_token_ids)
    pools = params.pooling is not None  # (it ends with its prompt: no output)
    if n_prompt > engine.max_model_len or (n_prompt == engine.max_model_len and not pools):
        raise ParamError(
            "prompt",
            f"the prompt has {n_prompt} tokens, but max_model_len is {engine.max_model_len}"
            + ("" if pools else ": no room is left for output"),
        )
    max_tokens = (
        0
        if pools
        else params.max_tokens
        if params.max_tokens is not None
        else engine.max_model_len - n_prompt
    )
    if n_prompt + max_tokens > engine.max_model_len:
        raise ParamError(
            "max_tokens",
            f"max_tokens={max_tokens} plus the prompt's {n_prompt} "
            f"tokens exceeds max_model_len={engine.max_model_len}",
        )
    if params.n > engine.config.max_num_seqs:
        raise ParamError("n", f"n={params.n} exceeds --max-num-seqs={engine.config.max_num_seqs}")
    bs = engine.config.block_size
    need = math.ceil(n_prompt / bs) + params.n * math.ceil((max_tokens + 1) / bs)
    if not engine.kv.can_fit(n_prompt + max_tokens) or (
        params.n > 1 and need > engine.kv.num_blocks
    ):
        cap = engine.kv.num_blocks * bs
        raise ParamError(
            "max_tokens",
            f"the request needs KV for {n_prompt} prompt + {max_tokens} "
            f"output tokens x n={params.n}, more than the KV pool holds "
            f"({cap} tokens); lower max_tokens or n, or give the pool more memory",
        )
    return max_tokens


def _check_first_token_allowed(params: SamplingParams, eos_token_ids: set[int]) -> None:
    """allowed_token_ids that bad_words (or, before min_tokens, the stop and EOS tokens) all forbid
    leave the first token nothing to be drawn from: the sampler would return garbage."""
    if not params.allowed_token_ids:
        return
    banned = set(completing_tokens([], params.bad_words_token_ids))
    if params.min_tokens:
        banned |= set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos_token_ids)
    if banned.issuperset(params.allowed_token_ids):
        raise ParamError(
            "allowed_token_ids",
            "every token of allowed_token_ids is forbidden at the first step (by bad_words, or "
            "as a stop or EOS token before min_tokens): nothing could be generated",
        )

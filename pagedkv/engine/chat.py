"""A conversation -> prompt text with the model's chat template, as vLLM renders it.

Shared by `LLM.chat` and the server's /tokenize, so both read
add_generation_prompt, continue_final_message and chat_template_kwargs alike.
"""

from __future__ import annotations

from typing import Any

from pagedkv.config import ConfigError

_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text; with continue_final_message the last (assistant) message is left open."""
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(set(kwargs) & set(_RESERVED))
    if clash:
        raise ConfigError(f"chat_template_kwargs must not set {', '.join(clash)}")
    if continue_final_message and add_generation_prompt:
        raise ConfigError("add_generation_prompt and continue_final_message cannot both be true")
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **kwargs
    )
    if not continue_final_message:
        return text
    final = str(messages[-1].get("content") or "").strip() if messages else ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ConfigError(
            "continue_final_message: the final message's text is not in the rendered template"
        )
    return text[: at + len(final)]  # cut the end-of-turn the template put after it

"""A conversation -> prompt text with the model's chat template, as vLLM renders it.

Shared by `LLM.chat`, the server's chat completions and its /tokenize (server/tools.py:
chat_prompt), so all three read add_generation_prompt, continue_final_message, tools, documents
and chat_template_kwargs alike.
"""

from __future__ import annotations

from typing import Any

from pagedkv.config import ConfigError
from pagedkv.model.tokenizer import template_content_format

# template variables with an argument of their own, which chat_template_kwargs may not set
RESERVED_TEMPLATE_ARGS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
        "documents",
        "bos_token",
        "eos_token",
    }
)


TEXT_PART_KEYS = frozenset({"type", "text"})


def content_text(content: Any) -> Any:
    """OpenAI content parts -> text: text parts joined by newlines, as vLLM's default ("string")
    content format joins them; any other part is an error. A string (or None) stays as it is."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise ConfigError(
                "only text content parts ({'type': 'text', 'text': ...}) are supported"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def shaped_content(content: Any, content_format: str) -> Any:
    """A message's content as the template takes it: "string" joins text parts, "openai" makes
    a string one text part (vLLM's --chat-template-content-format)."""
    if content_format == "string":
        return content_text(content)
    if isinstance(content, list):
        content_text(content)  # only text parts
        return [{"type": "text", "text": p["text"]} for p in content]
    return [{"type": "text", "text": content or ""}]


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> str:
    """The prompt text; with continue_final_message the last (assistant) message is left open.
    `chat_template` replaces the model's; template errors are ConfigErrors. `content_format`
    "auto" gives a template that loops over content parts a list of them, others a string."""
    if content_format == "auto":
        template = chat_template or tokenizer.chat_template or ""
        content_format = template_content_format(template)
    messages = [
        {**m, "content": shaped_content(m.get("content"), content_format)} for m in messages
    ]
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_ARGS & set(kwargs))
    if clash:
        raise ConfigError(
            f"chat_template_kwargs must not set {clash[0]!r}; it has its own argument"
        )
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        continue_final_message=continue_final_message,
        tools=tools,
        documents=documents,
        template_vars=kwargs,
    )

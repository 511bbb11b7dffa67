"""Reasoning models' `<think> ... </think>` sections (vLLM's `--reasoning-parser`).

One rule serves the grammar and the response: an output begins either inside a reasoning section
or undecided, as the prompt's last tag says (a template that opens `<think>` at the end of the
prompt, or one that closes an empty one to turn thinking off). With no tag in the prompt,
`deepseek_r1` starts inside (R1 models think first, their templates may leave the tag to the
model) and `qwen3` undecided. Undecided, a first token `<think>` opens the section and anything
else starts the answer; inside, the answer starts after `</think>`.

- The engine applies a structured-output grammar to the answer only, so a model can think
  before it writes the JSON it was asked for (`ThinkState`, over token ids). Undecided, the first
  token may be the grammar's or `<think>`.
- The chat response carries the section as `reasoning` and the answer as `content`
  (`split_reasoning`, over the text: both tags are single tokens that decode to themselves).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pagedkv.config import ConfigError

START, END = "<think>", "</think>"


class Section(Enum):
    THINK = "think"
    ANSWER = "answer"
    EITHER = "either"  # before the first token: `<think>` opens a section, anything else answers


@dataclass(frozen=True)
class ReasoningTags:
    parser: str
    start_id: int
    end_id: int

    @classmethod
    def of(cls, parser: str, tokenizer) -> ReasoningTags:
        """The parser's tags in this vocabulary: each must be one token that decodes to itself
        (a tag the tokenizer treats as special would vanish from the text)."""
        ids = []
        for tag in (START, END):
            token_id = tokenizer.token_id(tag)
            if token_id is None or tokenizer.decode([token_id]) != tag:
                raise ConfigError(
                    f"--reasoning-parser {parser}: the model's vocabulary has no {tag} token "
                    "that decodes to itself"
                )
            ids.append(token_id)
        return cls(parser, *ids)

    def first_section(self, prompt_ids: list[int]) -> Section:
        """Where the output begins: the prompt's last tag decides, else the parser."""
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return Section.EITHER
            if token == self.start_id:
                return Section.THINK
        return Section.THINK if self.parser == "deepseek_r1" else Section.EITHER


@dataclass
class ThinkState:
    """One sequence's place in its output: thinking, answering, or not yet decided."""

    tags: ReasoningTags
    section: Section

    @classmethod
    def of(cls, tags: ReasoningTags, prompt_ids: list[int], output_ids: list[int]) -> ThinkState:
        state = cls(tags, tags.first_section(prompt_ids))
        for token in output_ids:
            state.step(token)
        return state

    def step(self, token: int) -> bool:
        """Move past one output token; True if it belongs to the answer."""
        if self.section is Section.EITHER:
            self.section = Section.THINK if token == self.tags.start_id else Section.ANSWER
        elif self.section is Section.THINK:
            if token == self.tags.end_id:
                self.section = Section.ANSWER
            return False
        return self.section is Section.ANSWER


def split_reasoning(text: str, first: Section, final: bool) -> tuple[str, str]:
    """(reasoning, content) of an output so far that began in section `first`. While it runs
    (`final` false) a tail that may yet be a tag is held back, so that what is returned can
    only grow."""
    if first is Section.ANSWER:
        return "", text
    if text.startswith(START):  # a first <think> opens the section (or repeats the prompt's)
        text, first = text[len(START) :], Section.THINK
    elif not final and START.startswith(text):
        return "", ""  # nothing yet, or part of the tag
    elif first is Section.EITHER:
        return "", text
    at = text.find(END)
    if at == -1:
        return (text if final else hold_back(text, END)), ""
    return text[:at], text[at + len(END) :]


def hold_back(text: str, tag: str) -> str:
    """Text without a tail that could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text

"""Reasoning models' thinking sections (vLLM's `--reasoning-parser`).

Each parser names the marks that open and close a section: `<think>` and `</think>` (`deepseek_r1`,
`qwen3`), Mistral's `[THINK]` and `[/THINK]` control tokens (`mistral`: Magistral), or Granite's
phrases "Here is my thought process:" and "Here is my response:" (`granite`, which also reads
"Here's"). One rule serves the grammar, the thinking budget and the response: an output begins
either inside a section or undecided, as the prompt's last mark says (a template that opens
`<think>` at the end of the prompt, or one that closes an empty one to turn thinking off). With no
mark in the prompt, `deepseek_r1` starts inside (R1 models think first, their templates may leave
the tag to the model) and the others undecided. Undecided, an output that begins with an opening
mark opens the section and anything else starts the answer; inside, the answer starts after the
closing mark.

- The chat response carries the section as `reasoning` and the answer as `content`
  (`ReasoningSplit`, over the text: each mark decodes to itself).
- Where the marks are single tokens (every parser but `granite`), the engine also follows each
  sequence's section over token ids (`ThinkState`): a structured-output grammar constrains the
  answer only, so a model can think before it writes the JSON it was asked for (undecided, the
  first token may be the grammar's or the opening tag), and a request's `thinking_token_budget`
  closes a section that has run that many tokens by forcing the closing tokens (`ThinkTracker`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from pagedkv.config import ConfigError

if TYPE_CHECKING:
    import torch

    from pagedkv.engine.sequence import Sequence

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Marks:
    """The texts that open and close a section (any one of each)."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]


@dataclass(frozen=True)
class ReasoningFormat:
    marks: Marks
    thinks_first: bool = False  # with no mark in the prompt, the output begins inside a section
    tokens: bool = True  # each mark is one token (granite's are phrases)


GRANITE = Marks(
    ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:"),
)
FORMATS = {
    "deepseek_r1": ReasoningFormat(Marks((START,), (END,)), thinks_first=True),
    "qwen3": ReasoningFormat(Marks((START,), (END,))),
    "mistral": ReasoningFormat(Marks(("[THINK]",), ("[/THINK]",))),
    "granite": ReasoningFormat(GRANITE, tokens=False),
}


class Section(Enum):
    THINK = "think"
    ANSWER = "answer"
    EITHER = "either"  # before the first token: an opening mark opens a section, else the answer


@dataclass(frozen=True)
class ReasoningTags:
    """A parser's marks in this model's vocabulary: the opening and closing token ids (None for
    phrases), whether those tokens are special (decoded only when special tokens are kept), and
    the tokens a thinking budget forces to close a section (the closing tag, or --reasoning-config's
    reasoning_end_str ending with it)."""

    parser: str
    start_id: int | None
    end_id: int | None
    special: bool = False
    closing: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, parser: str, tokenizer, reasoning_config: dict | str | None = None
    ) -> ReasoningTags:
        """Each mark must be one token that decodes to itself (keeping special tokens, which a
        request of this server then decodes with)."""
        assert not isinstance(reasoning_config, str)  # EngineConfig parsed the flag's JSON
        fmt = FORMATS[parser]
        if not fmt.tokens:
            if reasoning_config:
                raise ConfigError(
                    f"--reasoning-config: --reasoning-parser {parser} reads phrases, not tokens: "
                    "a thinking budget needs a parser whose marks are tokens"
                )
            return cls(parser, None, None)
        ids, special = [], False
        for tag in (fmt.marks.starts[0], fmt.marks.ends[0]):
            token_id = tokenizer.token_id(tag)
            if token_id is None or tokenizer.decode([token_id], skip_special_tokens=False) != tag:
                raise ConfigError(
                    f"--reasoning-parser {parser}: the model's vocabulary has no {tag} token "
                    "that decodes to itself"
                )
            special |= tokenizer.decode([token_id]) != tag
            ids.append(token_id)
        closing = _closing(parser, fmt.marks, tokenizer, ids[1], reasoning_config or {})
        return cls(parser, ids[0], ids[1], special, closing)

    @property
    def marks(self) -> Marks:
        return FORMATS[self.parser].marks

    @property
    def tokens(self) -> bool:
        """Whether the engine can follow sections by token (grammar, thinking budget)."""
        return self.start_id is not None

    def first_section(self, prompt_ids: list[int]) -> Section:
        """Where the output begins: the prompt's last tag decides, else the parser."""
        for token in reversed(prompt_ids if self.tokens else ()):
            if token == self.end_id:
                return Section.EITHER
            if token == self.start_id:
                return Section.THINK
        return Section.THINK if FORMATS[self.parser].thinks_first else Section.EITHER

    def split_for(self, prompt_ids: list[int]) -> ReasoningSplit:
        return ReasoningSplit(self.marks, self.first_section(prompt_ids))


def _closing(parser: str, marks: Marks, tokenizer, end_id: int, config: dict) -> tuple[int, ...]:
    """The tokens a thinking budget forces: vLLM's --reasoning-config reasoning_end_str (a phrase
    may come before the closing tag, so that the model reads why it stopped), else the tag."""
    unknown = sorted(set(config) - {"reasoning_start_str", "reasoning_end_str"})
    if unknown:
        raise ConfigError(
            f"--reasoning-config: unknown key {unknown[0]!r} "
            "(it takes reasoning_start_str and reasoning_end_str)"
        )
    start = config.get("reasoning_start_str") or marks.starts[0]
    if start != marks.starts[0]:
        raise ConfigError(
            f"--reasoning-config: reasoning_start_str must be {marks.starts[0]!r}, the opening "
            f"tag of --reasoning-parser {parser}, got {start!r}"
        )
    end = config.get("reasoning_end_str") or marks.ends[0]
    ids = tokenizer.encode(end, add_special_tokens=False) if isinstance(end, str) else []
    if not ids or ids[-1] != end_id or end_id in ids[:-1]:
        raise ConfigError(
            f"--reasoning-config: reasoning_end_str must end with {marks.ends[0]!r}, the "
            f"closing tag of --reasoning-parser {parser} (once), got {end!r}"
        )
    return tuple(ids)


@dataclass
class ThinkState:
    """One sequence's place in its output: thinking (and for how many tokens), answering, or not
    yet decided."""

    tags: ReasoningTags
    section: Section
    thought: int = 0  # tokens of the present section so far

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
            else:
                self.thought += 1
            return False
        return self.section is Section.ANSWER

    def forced(self, budget: int) -> int | None:
        """The token the next one must be: once a section has run `budget` tokens, the closing
        tokens one by one (those count as thought too: the k-th after the budget is the k-th)."""
        if self.section is not Section.THINK or self.thought < budget:
            return None
        return self.tags.closing[min(self.thought - budget, len(self.tags.closing) - 1)]


class ThinkTracker:
    """Each followed sequence's ThinkState (those with a grammar or a thinking budget), built
    from its tokens when first asked for and then stepped with each token it draws: a
    sequence's state survives preemption, and a fork (n, beams) builds its own."""

    def __init__(self, tags: ReasoningTags) -> None:
        assert tags.tokens
        self.tags = tags
        self._states: weakref.WeakKeyDictionary[Sequence, ThinkState] = weakref.WeakKeyDictionary()

    @staticmethod
    def follows(seq: Sequence) -> bool:
        p = seq.params
        return p.structured_outputs is not None or p.thinking_token_budget is not None

    def state(self, seq: Sequence) -> ThinkState:
        state = self._states.get(seq)
        if state is None:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            state = self._states[seq] = ThinkState.of(self.tags, prompt, seq.output_token_ids)
        return state

    def force(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place: a row whose thinking budget has run out can draw only its next closing
        token (whatever else its rules say, as vLLM forces it)."""
        for i, seq in enumerate(seqs):
            budget = seq.params.thinking_token_budget
            if budget is not None and (token := self.state(seq).forced(budget)) is not None:
                logits[i].fill_(float("-inf"))
                logits[i, token] = 0.0

    def advance(self, seqs: list[Sequence], tokens: list[int]) -> list[bool]:
        """Step each followed row past its drawn token; True where the token is the answer's
        (every row not followed)."""
        return [
            self.state(seq).step(token) if self.follows(seq) else True
            for seq, token in zip(seqs, tokens)
        ]


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's text as (reasoning, content), for an output that began in section `first`."""

    marks: Marks
    first: Section

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """While the output runs (`final` false) a tail that may yet be a mark is held back, so
        that what is returned can only grow."""
        if self.first is Section.ANSWER:
            return "", text
        opened = next((m for m in self.marks.starts if text.startswith(m)), None)
        if opened is not None:  # an opening mark first opens the section (or repeats the prompt's)
            text = text[len(opened) :]
        elif not final and any(m.startswith(text) for m in self.marks.starts):
            return "", ""  # nothing yet, or part of a mark
        elif self.first is Section.EITHER:
            return "", text
        found = [(at, m) for m in self.marks.ends if (at := text.find(m)) != -1]
        if not found:
            return (text if final else hold_back(text, *self.marks.ends)), ""
        at, end = min(found)
        return text[:at], text[at + len(end) :]


def hold_back(text: str, *tags: str) -> str:
    """Text without the longest tail that could be the start of one of `tags`."""
    for k in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-k:]) and len(t) > k for t in tags):
            return text[:-k]
    return text

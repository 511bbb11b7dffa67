"""Structured outputs: llguidance grammars, one matcher per sequence, one bitmask per step.

Compiling a grammar (a JSON schema, a regex, a Lark grammar) takes from microseconds to a second,
so the server compiles it off the engine thread before the request is queued (a grammar that does
not compile is a 400 then) and keeps compiled matchers in a small LRU cache: the engine thread only
deep-copies one per sequence. Each step the sampler gets one int32 bitmask for the whole batch
(rows without a grammar allow every token), each constrained row filled by its matcher (one after
the other: llguidance's thread pool, LLExecutor, measured slower on a busy 2-core CPU), and applies
it in one pass: a byte lookup table turns the bits into 0 / -inf logit offsets, added to the logits
(branch-free; masked_fill with a mixed mask ran 7x slower). The sampled tokens are fed back to the
matchers; a sequence whose grammar can take no more tokens is finished.

JSON is generated compact (no optional whitespace): the same values, and a model cannot pad the
output with blank lines until max_tokens.

With a reasoning parser whose marks are tokens (engine/reasoning.py) the grammar constrains the
answer only: rows still thinking are left free, and a row whose first token is undecided may also
draw the opening tag.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
import torch

from pagedkv.config import ConfigError
from pagedkv.engine.reasoning import Section, ThinkState, ThinkTracker
from pagedkv.engine.request import StructuredOutputsParams
from pagedkv.engine.sequence import Sequence

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

CACHE_SIZE = 64
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# byte value -> its 8 bits as logit offsets (0: allowed, -inf: not): unpacking is one gather
_BYTE_BIAS = torch.where(
    ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for one constraint (not yet checked)."""
    try:
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.grammar_from("regex", spec.regex)
        if spec.choice is not None:
            # the stub says str; "choice" takes the list itself too (llguidance's _grammar_from.py)
            return llguidance.grammar_from("choice", spec.choice)  # type: ignore[arg-type]
        assert spec.grammar is not None  # exactly one field is set (StructuredOutputsParams)
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise ConfigError(f"structured output: {e}") from None


class StructuredOutputs:
    """Grammar compilation (cached) and the per-sequence matchers of one engine."""

    def __init__(self, tokenizer, vocab_size: int, thinking: ThinkTracker | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.thinking = thinking
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._matchers: weakref.WeakKeyDictionary[Sequence, llguidance.LLMatcher] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:  # built on first use: plain requests never pay for it
            tok = self._tokenizer
            self._lltok = llguidance.LLTokenizer(
                tok.to_json(), n_vocab=self._vocab_size, eos_token=sorted(tok.eos_token_ids)
            )
        return self._lltok

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`; ConfigError (a 400) if it does not compile. Thread-safe."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key].deep_copy()
            lltok = self.lltokenizer
        matcher = llguidance.LLMatcher(lltok, grammar_of(spec), log_level=0)  # drops the GIL
        if matcher.is_error():
            raise ConfigError(
                f"structured output: the grammar does not compile: {matcher.get_error()}"
            )
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return matcher.deep_copy()

    def _matcher(self, seq: Sequence) -> llguidance.LLMatcher:
        m = self._matchers.get(seq)
        if m is None:
            spec = seq.params.structured_outputs
            assert spec is not None  # only constrained sequences get a matcher
            m = self.compile(spec)
            m.consume_tokens(self._answer(seq))  # empty, unless created after a fork
            self._matchers[seq] = m
        return m

    def _answer(self, seq: Sequence) -> list[int]:
        """The output tokens the grammar has taken: all of them, or the answer's."""
        if self.thinking is None:
            return seq.output_token_ids
        state = ThinkState.of(self.thinking.tags, seq.token_ids[: seq.num_prompt_tokens], [])
        return [t for t in seq.output_token_ids if state.step(t)]

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask, in place, every token the grammar of each constrained row forbids.

        One bitmask holds the constrained rows (unconstrained ones cost nothing), each filled by
        its matcher; one index_add_ puts the 0 / -inf offsets on those rows of the logits."""
        rows: list[int] = []
        undecided: list[bool] = []  # the first token may also be <think>
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs is None:
                continue
            section = Section.ANSWER if self.thinking is None else self.thinking.state(seq).section
            if section is not Section.THINK:  # a row still thinking is left free
                rows.append(i)
                undecided.append(section is Section.EITHER)
        if not rows:
            return
        vocab = logits.shape[1]
        bitmask = torch.empty((len(rows), (vocab + 31) // 32), dtype=torch.int32)
        row_bytes = bitmask.shape[1] * 4
        for k, i in enumerate(rows):  # llguidance writes each row in place, the GIL released
            self._matcher(seqs[i]).unsafe_compute_mask_ptr(bitmask[k].data_ptr(), row_bytes)
            if undecided[k]:
                assert self.thinking is not None  # only a reasoning parser leaves it undecided
                start_id = self.thinking.tags.start_id
                assert start_id is not None  # (a tracker's tags are tokens)
                byte, bit = divmod(start_id, 8)  # the model may think first
                bitmask[k].view(torch.uint8)[byte] |= 1 << bit
        bias = _BYTE_BIAS.index_select(0, bitmask.view(torch.uint8).view(-1).long())
        index = torch.tensor(rows)
        logits.index_add_(0, index, bias.view(len(rows), -1)[:, :vocab])  # branch-free

    def accept(self, seqs: list[Sequence], tokens: list[int], answers: list[bool]) -> list[bool]:
        """Advance each constrained row's matcher by its token if that is the answer's (not a
        reasoning section's); True where its grammar is now complete."""
        done = [False] * len(seqs)
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.params.structured_outputs is None or not answers[i]:
                continue
            m = self._matcher(seq)
            m.consume_token(token)
            done[i] = m.is_stopped()  # also true in an error state: the output cannot go on
        return done

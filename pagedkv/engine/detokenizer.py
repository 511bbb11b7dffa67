"""Incremental detokenization and stop strings.

Decoding token by token would split multi-byte characters (an emoji spread
over several byte-level tokens) and lose the spacing some tokenizers derive
from context. So each step decodes a short window of recent tokens twice and
keeps only the new, complete suffix (the scheme vLLM uses).
"""

from __future__ import annotations

from pagedkv.engine.sequence import Sequence

_CONTEXT = 5  # tokens of left context kept in the decode window


def init_offsets(seq: Sequence) -> None:
    seq.prefix_offset = max(len(seq.token_ids) - _CONTEXT, 0)
    seq.read_offset = len(seq.token_ids)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> bool:
        """Append the new token's text to seq.text; True if a stop string now ends the output."""
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self.tokenizer.decode(
            ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip
        )
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        old_len = len(seq.text)
        seq.text += full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        if seq.num_output_tokens <= seq.params.min_tokens:
            return False  # stop strings wait for min_tokens too (as in vLLM), like EOS does
        return self._check_stop(seq, old_len)

    @staticmethod
    def _check_stop(seq: Sequence, old_len: int) -> bool:
        for stop in seq.params.stop or ():  # a list once validated
            start = max(old_len - len(stop) + 1, 0)  # only where the new text could complete it
            at = seq.text.find(stop, start)
            if at != -1:
                keep = len(stop) if seq.params.include_stop_str_in_output else 0
                seq.text = seq.text[: at + keep]  # the stop string is shown only if asked for
                seq.stop_reason = stop
                return True
        return False


def visible_text(seq: Sequence) -> str:
    """While running, hold back a tail that could still grow into a stop string."""
    text = seq.text
    if seq.finished or not seq.params.stop:
        return text
    hold = 0
    for stop in seq.params.stop:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return text[: len(text) - hold]

"""Per-request token rules applied to the logits before sampling: logit_bias, allowed_token_ids,
bad_words (all with vLLM's meaning). Only rows that set one of them cost anything.
"""

from __future__ import annotations

import torch

from pagedkv.engine.sequence import Sequence


def apply_token_rules(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place: add logit_bias, keep allowed_token_ids only, forbid what completes a bad word."""
    vocab = logits.shape[1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.allowed_token_ids:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        if p.bad_words_token_ids:
            banned = completing_tokens(seq.output_token_ids, p.bad_words_token_ids)
            if banned:
                logits[i, banned] = float("-inf")


def completing_tokens(output: list[int], words: list[list[int]]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far."""
    banned = []
    for word in words:
        head = word[:-1]
        if not head or output[len(output) - len(head) :] == head:
            banned.append(word[-1])
    return banned


def bad_words_token_ids(tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word tokenized as it starts the text and, when that differs, after a space.

    vLLM keeps the spaced form only when it has as many tokens; here it is always kept, so " quick"
    is banned with "quick" even where the tokenizer has a single token for the spaced word."""
    out: list[list[int]] = []
    for word in bad_words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(alone)
        if spaced and spaced != alone:
            out.append(spaced)
    return out

"""prompt_logprobs: the log probability of every prompt token given the ones before it.

The runner hands over the hidden rows of the prompt positions a step computed (see
`ModelRunner.attach_prompt_hidden`); here they become logits a slice at a time, so a long prompt
never holds a [prompt length x vocab] tensor. Such a request skips the prefix cache: a cached
block's positions are never computed, so their logits would not exist.
"""

from __future__ import annotations

import torch

from pagedkv.engine.outputs import SampleLogprob as Logprob

ROWS_PER_SLICE = 256


def token_logprobs(logp: torch.Tensor, tokens: torch.Tensor, k: int) -> list[Logprob]:
    """Per row of log-probabilities: the chosen token's, its rank (1 = most likely), the top k."""
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    ranks = (logp > chosen[:, None]).sum(1) + 1
    top_k = logp.topk(k, -1) if k else None
    out = []
    for i, (token, value, rank) in enumerate(zip(tokens.tolist(), chosen.tolist(), ranks.tolist())):
        top = {}
        if top_k is not None:
            top = dict(zip(top_k.indices[i].tolist(), top_k.values[i].tolist()))
        out.append(Logprob(token, value, top, rank))
    return out


def record(model, scheduled, as_logits: bool = False) -> None:
    """Append the logprobs of the prompt positions computed this step to their requests (their
    logits with `as_logits`: --logprobs-mode raw_logits or processed_logits, which are the same
    for a prompt, drawn from no rule)."""
    for s in scheduled:
        if s.prompt_hidden is None:
            continue
        first, hidden = s.prompt_hidden
        s.prompt_hidden = None
        group = s.seq.group
        for at in range(0, len(hidden), ROWS_PER_SLICE):
            logp = model.compute_logits(hidden[at : at + ROWS_PER_SLICE]).float().cpu()
            if not as_logits:
                logp = logp.log_softmax(-1)
            start = first + at + 1  # logits at position p give the probability of token p + 1
            targets = torch.tensor(
                group.prompt_token_ids[start : start + len(logp)], dtype=torch.long
            )
            group.prompt_logprobs.extend(
                token_logprobs(logp, targets, group.params.prompt_logprobs)
            )

"""Turn a batch of logits into next tokens, each row with its own parameters.

Everything is vectorised over the batch; per-row work is limited to building
small index tensors. Each sample draws from its own random stream (one
uniform number per token, inverse-CDF), so a seeded request gives the same
tokens alone or in any batch, given the same logits: exact in float32; in bfloat16 a batch's
other matmul shapes round the logits differently and can flip a near-tie (as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv import native
from pagedkv.engine.logits_processors import apply_token_rules
from pagedkv.engine.outputs import SampleLogprob as Logprob
from pagedkv.engine.sequence import Sequence


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprob | None]
    grammar_done: list[bool] | None = None  # per row: its structured-output grammar is complete


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, on a copy: the
    engine samples the same logits again, request by request, when a batch fails."""
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.params.repetition_penalty != 1.0
        or s.params.presence_penalty
        or s.params.frequency_penalty
    ]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        p = seqs[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seqs[i].token_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        out = seqs[i].output_token_ids
        if out and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[
                :vocab
            ].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _block_stop_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: set[int]) -> None:
    """Until min_tokens are out, EOS and stop token ids cannot be drawn."""
    for i, s in enumerate(seqs):
        p = s.params
        if s.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else eos_ids)
            if banned:
                logits[i, sorted(t for t in banned if t < logits.shape[1])] = float("-inf")


def _end_dead_rows(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    """A row whose rules (allowed_token_ids or a grammar, with bad_words and min_tokens) leave no
    token ends with EOS: drawing from nothing gave a token outside the rules and a NaN logprob.
    Only rows with a whitelist can lose every token, so only they are checked."""
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.params.allowed_token_ids or s.params.structured_outputs is not None
    ]
    if not rows:
        return
    index = torch.tensor(rows)
    dead = index[logits.index_select(0, index).amax(-1) == float("-inf")]
    if len(dead):
        eos = torch.tensor(sorted(eos_token_ids))
        logits[dead[:, None], eos[None, :]] = 0.0


def _truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask tokens outside top-k / top-p / min-p with -inf.

    Rows with the filters off are unchanged."""
    vocab = logits.shape[1]
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    need_k = bool(((top_k > 0) & (top_k < vocab)).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        drop |= torch.arange(vocab)[None, :] >= k[:, None]
    if need_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = (
            probs.cumsum(-1) - probs
        )  # mass strictly before each token: keep the first over top_p
        drop |= before >= top_p[:, None]
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (int64): the C++ kernel where it is built (0.1 ms at [64, 49152]
    against torch's 1.4), else torch's max, whose indices and NaN rule it follows."""
    lib = native.library_for(logits)
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] > 2**24:
        return logits.max(-1).indices
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.call(
        "argmax",
        x=logits.data_ptr(),
        x_stride=logits.stride(0),
        out=out.data_ptr(),
        rows=logits.shape[0],
        n=logits.shape[1],
        threads=torch.get_num_threads(),
    )
    return out


class Sampler:
    def __init__(
        self,
        eos_token_ids: set[int],
        structured=None,
        thinking=None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.structured = structured  # engine.structured.StructuredOutputs: grammar masks
        self.thinking = thinking  # engine.reasoning.ThinkTracker: sections, thinking budgets
        # --logprobs-mode (vLLM's): raw values come from the model's logits before any rule,
        # processed ones from those the token was drawn from; logits or their log-softmax
        self.raw_logprobs = logprobs_mode.startswith("raw")
        self.as_logits = logprobs_mode.endswith("logits")

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], uniforms: list[float]
    ) -> SampleResult:
        """logits: [B, vocab] float32, row i for seqs[i]; uniforms[i] in [0, 1) draws its token
        if it samples. Changes in place only what a second call would change the same way."""
        shown = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        shown_rows = torch.tensor(shown, dtype=torch.long) if shown else None
        raw = logits[shown_rows].float() if shown_rows is not None and self.raw_logprobs else None
        logits = _penalize(logits.float(), seqs)
        _block_stop_tokens(logits, seqs, self.eos_token_ids)
        apply_token_rules(logits, seqs)
        if self.structured is not None:
            self.structured.apply(logits, seqs)
        if self.thinking is not None:
            self.thinking.force(logits, seqs)
        _end_dead_rows(logits, seqs, self.eos_token_ids)
        params = [s.params for s in seqs]
        greedy = torch.tensor([p.temperature == 0.0 for p in params])
        tokens = greedy_tokens(logits)
        processed = logits  # what each row's token is drawn from (a greedy row: its maximum)
        if not bool(greedy.all()):
            temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
            top_k = torch.tensor([p.top_k for p in params])
            top_p = torch.tensor([p.top_p for p in params])
            min_p = torch.tensor([p.min_p for p in params])
            truncated = _truncate(logits / temp[:, None], top_k, top_p, min_p)
            probs = truncated.softmax(-1)
            if shown and raw is None:
                processed = torch.where(greedy[:, None], logits, truncated)
            u = torch.tensor(uniforms, dtype=torch.float64)
            cdf = probs.double().cumsum(-1)
            drawn = (
                torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])
                .squeeze(1)
                .clamp(max=logits.shape[1] - 1)
            )
            tokens = torch.where(greedy, tokens, drawn)
        token_list = tokens.tolist()
        answers = (
            self.thinking.advance(seqs, token_list)
            if self.thinking is not None
            else [True] * len(seqs)
        )
        done = (
            self.structured.accept(seqs, token_list, answers)
            if self.structured is not None
            else None
        )
        logprobs: list[Logprob | None] = [None] * len(seqs)
        if shown_rows is not None:
            values = raw if raw is not None else processed[shown_rows]
            records = self._logprobs(
                values, [seqs[i] for i in shown], [token_list[i] for i in shown]
            )
            for i, record in zip(shown, records):
                logprobs[i] = record
        return SampleResult(token_list, logprobs, done)

    def _logprobs(
        self, values: torch.Tensor, seqs: list[Sequence], tokens: list[int]
    ) -> list[Logprob]:
        """values: one row a sequence that asks for logprobs, in --logprobs-mode's units before
        the log-softmax; each its token's value and rank, and the top `logprobs` values (or
        those of its logprob_token_ids)."""
        logp = values if self.as_logits else values.log_softmax(-1)
        k = max(s.params.logprobs or 0 for s in seqs)
        top = logp.topk(k, -1) if k else None
        result = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            w = seq.params.logprobs
            alts: dict[int, float] = {}
            if ids := seq.params.logprob_token_ids:  # instead of the top ones
                alts = dict(zip(ids, logp[i, ids].tolist()))
            elif w and top is not None:
                alts = dict(zip(top.indices[i, :w].tolist(), top.values[i, :w].tolist()))
            chosen = logp[i, token]
            result.append(Logprob(token, float(chosen), alts, int((logp[i] > chosen).sum()) + 1))
        return result

"""A mixture of experts in place of a layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE).

A router scores every expert for each token; each token runs through the k experts it scores
highest, and their outputs are summed weighted by the router's softmax probabilities
(renormalised over the k where the model says so, or GraniteMoE's softmax over the k logits).
The step's tokens are grouped by expert, so each expert multiplies all the rows routed to it in
one matmul, with its weights in whatever form `quant_linear.linear` takes (plain, prepacked for
our GEMMs, int8, GGUF blocks): an expert is a small MLP like any other. Its outputs are added to
their tokens' rows expert by expert, in expert order, as transformers adds them (so float32 sums
are the same, bit for bit). Qwen2-MoE adds a shared expert that every token runs, gated by a
sigmoid of its own projection.

Only the experts some token chose are read, which is what makes a mixture cheap to decode: a
single stream of Qwen3-30B-A3B reads 3B of its 30B parameters a token. A batch that touches every
expert reads them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from pagedkv.model.config import LlamaConfig
from pagedkv.model.quant_linear import Weight, frozen, linear


class Expert(nn.Module):
    """One gated MLP: gate and up fused into one weight (gate first), then down."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: str | None) -> None:
        super().__init__()
        self.gate_up_proj = frozen(2 * inter, hidden, dtype=dtype, device=device)
        self.down_proj = frozen(hidden, inter, dtype=dtype, device=device)

    def weights(self) -> tuple[Weight, Weight]:
        """(gate_up, down): parameters, or what quantizing or prepacking replaced them with."""
        return self.gate_up_proj, self.down_proj


class SparseMoE(nn.Module):
    """The router, the experts and (Qwen2-MoE) the gated shared expert of one layer."""

    shared: Expert | None
    # set by refresh_weights in __dict__ (declared for mypy): each expert's (gate_up, down)
    _experts: list[tuple[Weight, Weight]]
    _shared: tuple[Weight, Weight] | None

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, device: str | None = None) -> None:
        super().__init__()
        c = config
        self.k = c.experts_per_token
        self.renormalise = c.norm_topk_prob
        self.softmax_over_chosen = c.softmax_over_chosen
        self.float_weights = c.float_routing_weights
        self.router = frozen(c.num_experts, c.hidden_size, dtype=dtype)  # never quantized
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, c.moe_intermediate_size, dtype, device)
            for _ in range(c.num_experts)
        )
        self.shared = None
        if c.shared_expert_size:
            self.shared = Expert(c.hidden_size, c.shared_expert_size, dtype, device)
            self.shared_gate = frozen(1, c.hidden_size, dtype=dtype)
        self.refresh_weights()

    def refresh_weights(self) -> None:
        """Plain references for forward (see DecoderLayer.refresh_weights)."""
        self.__dict__["_experts"] = [cast(Expert, e).weights() for e in self.experts]
        self.__dict__["_shared"] = None if self.shared is None else self.shared.weights()

    def forward(self, h: Tensor, act: Callable[[Tensor], Tensor], out: Tensor) -> Tensor:
        """The mixture's output for rows h [T, hidden], written into out [T, hidden]."""
        logits = linear(h, self.router)
        if self.softmax_over_chosen:  # (GraniteMoE's: the same weights, rounded otherwise)
            weights, chosen = logits.float().topk(self.k, dim=-1)
            weights = torch.softmax(weights, dim=-1)
        else:
            weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.k)
            if self.renormalise:
                weights /= weights.sum(dim=-1, keepdim=True)
        if not self.float_weights:
            weights = weights.to(h.dtype)
        # the (token, choice) pairs grouped by expert, tokens in order within each group
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        rows, weights = order // self.k, weights.flatten()[order]
        out.zero_()
        start = 0
        for expert, n in enumerate(flat.bincount(minlength=len(self._experts)).tolist()):
            if n:
                gate_up, down = self._experts[expert]
                picked = rows[start : start + n]
                y = linear(act(linear(h[picked], gate_up)), down)
                out.index_add_(0, picked, (y * weights[start : start + n, None]).to(out.dtype))
                start += n
        if self._shared is not None:
            gate_up, down = self._shared
            gate = torch.sigmoid(linear(h, self.shared_gate))
            out += gate * linear(act(linear(h, gate_up)), down)
        return out

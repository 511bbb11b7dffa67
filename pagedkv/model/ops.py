"""The ops around a decoder layer's matmuls: one fused C++ call each (csrc/layer_ops.cpp) when
the native library is built and the tensors are CPU ones it knows (native.library_for), else the
same arithmetic in plain torch (the reference the C++ is tested against). RoPE, fused with the
K/V store, belongs to attention (attention/store.py).

Fusing them takes a decode step of SmolLM2-135M from about 40 torch ops per layer to 8 calls,
and a 2048-token prompt chunk from several slow bf16 passes over memory to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedkv import native


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    out: Tensor | None = None,
    x_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """RMSNorm of x, or of x * x_scale + residual when a residual is given (vLLM's fused add;
    x_scale: Granite's residual_multiplier, rounded to x's dtype before the add as transformers
    does).

    Returns (normed, the new residual); the residual tensor given is updated in place. With no
    residual, x itself is the new residual. The kernel writes into `out` when it fits
    (native.output; a buffer the forward reuses), the torch path into a new tensor.
    """
    rows, n = x.shape
    lib = (
        native.library_for(x, weight)
        if residual is None
        else native.library_for(x, weight, residual)
    )
    if lib is None or (residual is not None and not residual.is_contiguous()):
        if residual is not None:
            x = residual.add_(x * x_scale if x_scale != 1.0 else x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype), x
    out = native.output(out, (rows, n), x.dtype)
    lib.call(
        "rms_norm",
        dtype=native.DTYPES[x.dtype],
        x=x.data_ptr(),
        x_stride=x.stride(0),
        residual=native.ptr(residual),
        weight=weight.data_ptr(),
        out=out.data_ptr(),
        rows=rows,
        n=n,
        eps=eps,
        threads=torch.get_num_threads(),
        x_scale=x_scale,
    )
    return out, (x if residual is None else residual)


def gelu_tanh_mul(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """GELU(gate) (tanh approximation: Gemma's gelu_pytorch_tanh) * up, as silu_mul."""
    return silu_mul(gate_up, out, gelu=True)


def silu_mul(gate_up: Tensor, out: Tensor | None = None, gelu: bool = False) -> Tensor:
    """SiLU(gate) * up of a fused [rows, 2 * n] gate | up projection: [rows, n] (in `out` as
    rms_norm's). gelu: GELU (tanh approximation) in place of SiLU."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    lib = native.library_for(gate_up)
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    out = native.output(out, (rows, n), gate_up.dtype)
    lib.call(
        "silu_mul",
        dtype=native.DTYPES[gate_up.dtype],
        x=gate_up.data_ptr(),
        x_stride=gate_up.stride(0),
        out=out.data_ptr(),
        rows=rows,
        n=n,
        threads=torch.get_num_threads(),
        gelu=int(gelu),
    )
    return out

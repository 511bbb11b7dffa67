"""The Hadamard rotation of quantized KV caches: its one home.

Quantized caches (fp8, int8: kv/quant.py) hold K and V rotated by an orthonormal Hadamard matrix
R over head_dim, because real keys have a few outlier channels. For fp8 (3 mantissa bits, each
element off by up to 6%) a score q.k dominated by those channels inherits their error almost
whole; rotated, it is spread over all channels, whose errors partly cancel. For int8 the outliers
set the step for every channel of the head; rotated, the amax shrinks towards the typical
magnitude and the steps get finer. Attention works in the rotated space: (qR).(kR) = q.k and
sum p (vR) = (sum p v) R, so new K/V are rotated before they are quantized, and attention rotates
q on the way in and its output back with R^T = R. The C++ kernels do this themselves (the
quantized write, csrc/kv_quant.cpp, and paged attention over a quantized cache, with vec.h's
hadamard); the torch paths call rotate / unrotate here (kvstore/quant.py, attention/paged.py).
Both run the same butterflies in the same order, so they agree bit for bit. On SmolLM2 this takes
fp8's perplexity cost from about 1.4% to about 0.4% and cuts int8's mean logit error by a third
(BENCHMARKS.md). The cache itself only ever sees rotated values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def hadamard(dim: int) -> Tensor:
    """Orthonormal float32 [dim, dim]: Sylvester Hadamard blocks as large as the power of two
    dividing dim allows (exact and the same everywhere, so stored blocks stay readable)."""
    size = dim & -dim
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h] * (dim // size)) / math.sqrt(size)


def rotate(x: Tensor) -> Tensor:
    """x R over the last dimension, in float32 (what a quantized cache stores, before scaling):
    the fast Walsh-Hadamard transform, butterflies of stride 1, 2, 4, ... within each Sylvester
    block, then the 1 / sqrt(size) scale, as vec.h's hadamard does them."""
    dim = x.shape[-1]
    size = dim & -dim
    y = x.float().reshape(-1, dim)
    stride = 1
    while stride < size:
        pairs = y.view(-1, dim // (2 * stride), 2, stride)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        stride *= 2
    return y.reshape(x.shape) * (1.0 / math.sqrt(size))


def unrotate(x: Tensor) -> Tensor:
    """x R^T over the last dimension, in float32: back from the rotated space (R is symmetric and
    orthonormal, so R^T = R)."""
    return rotate(x)

"""Greedy tokens by the C++ argmax (csrc/argmax.cpp) on every vector ISA this CPU runs, against
torch's `max(-1).indices`: the first maximum of each row, NaN counted as the largest."""

from __future__ import annotations

import pytest
import torch
from native_variants import kernel_isa  # noqa: F401 - a fixture

from pagedkv import native
from pagedkv.engine.sampler import greedy_tokens


def rows_with_edges(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 3, (7, n), generator=gen).float()  # many ties
    x[1] = float("-inf")  # every token blocked: index 0, as torch
    x[2, n // 2] = float("nan")
    x[2, -1] = float("nan")
    x[3, n // 3] = float("inf")
    x[3, -1] = float("inf")
    x[4] = torch.randn(n, generator=gen)
    x[5, -1] = 100.0  # the last lane of a masked tail
    x[6] = -1e30
    return x


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 49152])
def test_the_first_maximum_of_every_row(n, kernel_isa) -> None:  # noqa: F811
    x = rows_with_edges(n)
    assert torch.equal(greedy_tokens(x), x.max(-1).indices)
    wide = torch.cat([x, torch.full((7, 5), 1e9)], dim=1)[:, :n]  # rows of a wider tensor
    assert torch.equal(greedy_tokens(wide), x.max(-1).indices)


def test_what_the_kernel_does_not_take_goes_to_torch() -> None:
    assert native.available()
    half = rows_with_edges(40).to(torch.bfloat16)
    assert torch.equal(greedy_tokens(half), half.max(-1).indices)
    with pytest.raises(native.KernelError, match="n <= 2"):
        native.library().call(
            "argmax", x=half.data_ptr(), x_stride=1, out=half.data_ptr(), rows=1, n=0, threads=1
        )

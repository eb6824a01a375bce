"""``nearswap``: hand-computed values and properties."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

Merge = Callable[..., torch.Tensor]


def test_nearswap_takes_close_values_and_blends_far_ones(merge: Merge) -> None:
    base = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    other = torch.tensor([[0.05, 1.0, -0.2], [1.0, 3.0, 0.0]])
    out = merge("nearswap", [base, other], base=0, params={"t": 0.1})
    # w = clamp(0.1 / |Δ|, 0, 1) = [[1, 0.1, 0.5], [1, 0.05, 0.1]]
    expected = torch.tensor([[0.05, 0.1, -0.1], [1.0, 1.1, 0.9]])
    assert_close(out, expected, rtol=1e-6, atol=1e-7)


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**16))
def test_nearswap_extremes(merge: Merge, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    base, other = torch.randn(2, 3, 4, generator=gen)
    assert torch.equal(merge("nearswap", [base, other], base=0, params={"t": 0.0}), base)
    assert torch.equal(merge("nearswap", [other, base], base=1, params={"t": 1e9}), other)

"""``ram`` and ``ramplus_tl``: hand-computed values and properties."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

Merge = Callable[..., torch.Tensor]

BASE = torch.zeros(2, 3)
# with epsilon 0.5: model 1 touches [0,0] [0,2] [1,1] [1,2]; model 2 touches [0,0] [1,1] [1,2]
D1 = torch.tensor([[1.0, 0.1, 2.0], [0.0, 3.0, -1.0]])
D2 = torch.tensor([[3.0, 0.0, 0.2], [0.0, 1.0, 1.0]])


def test_ram_keeps_unique_updates_and_averages_shared_ones(merge: Merge) -> None:
    out = merge("ram", [BASE, D1, D2], base=0, params={"epsilon": 0.5})
    # untouched entries (0.1, 0.2) contribute nothing
    assert torch.equal(out, torch.tensor([[2.0, 0.0, 2.0], [0.0, 2.0, 0.0]]))


def test_ramplus_amplifies_unique_updates_by_overlap(merge: Merge) -> None:
    params = {"epsilon": 0.5, "r": 0.5, "alpha": 1.0}
    out = merge("ramplus_tl", [BASE, D1, D2], base=0, params=params)
    # model 1 shares 3 positions and owns 1: ρ = 3, clipped to alpha = 1, so λ = 1 + 0.5 · 1
    assert torch.equal(out, torch.tensor([[2.0, 0.0, 3.0], [0.0, 2.0, 0.0]]))


def test_ramplus_returns_float32_for_half_inputs_like_mergekit(merge: Merge) -> None:
    tensors = [x.to(torch.bfloat16) for x in (BASE, D1, D2)]
    out = merge("ramplus_tl", tensors, base=0, params={"epsilon": 0.5})
    assert out.dtype == torch.float32
    assert merge("ram", tensors, base=0, params={"epsilon": 0.5}).dtype == torch.bfloat16


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4))
def test_ram_of_disjoint_updates_is_their_sum(merge: Merge, seed: int, n: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 6, generator=gen)
    owner = torch.randint(0, n, (4, 6), generator=gen)
    deltas = [(owner == i) * (1 + torch.rand(4, 6, generator=gen)) for i in range(n)]
    out = merge("ram", [base] + [base + d for d in deltas], base=0)
    torch.testing.assert_close(out, base + sum(deltas, torch.zeros(4, 6)))

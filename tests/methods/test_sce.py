"""``sce``: hand-computed values and properties."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.testing import assert_close

Merge = Callable[..., torch.Tensor]

BASE = torch.zeros(2, 2)
D1 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # mean square 7.5
D2 = torch.tensor([[-1.0, 2.0], [1.0, 0.0]])  # mean square 1.5


def test_sce_weights_by_energy_among_sign_agreeing_models(merge: Merge) -> None:
    out = merge("sce", [BASE, D1, D2], base=0)
    # energies → [5/6, 1/6]; all elected signs are +, so D2's −1 and 0 are erased
    assert_close(out, torch.tensor([[1.0, 2.0], [16 / 6, 4.0]]), rtol=1e-6, atol=0)


def test_sce_select_topk_keeps_high_variance_positions(merge: Merge) -> None:
    out = merge("sce", [BASE, D1, D2], base=0, params={"select_topk": 0.5})
    # variances [1, 0, 1, 4]: three nonzero, int(3 · 0.5) = 1 kept, the variance-4 position
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [0.0, 4.0]]))


def test_sce_select_topk_zero_returns_the_base(merge: Merge) -> None:
    base = torch.ones(2, 2)
    assert torch.equal(merge("sce", [base, base + D1, base + D2], base=0, params={"select_topk": 0.0}), base)


def test_sce_int8_mask_does_not_change_the_result(merge: Merge) -> None:
    tensors = [BASE, D1, D2]
    for topk in (1.0, 0.5):
        plain = merge("sce", tensors, base=0, params={"select_topk": topk})
        assert torch.equal(plain, merge("sce", tensors, base=0, params={"select_topk": topk, "int8_mask": True}))


def test_sce_of_zero_task_vectors_is_the_base(merge: Merge) -> None:
    base = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(merge("sce", [base, base, base], base=0), base)

"""``model_stock``: hand-computed values and properties."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

Merge = Callable[..., torch.Tensor]
C = math.sqrt(0.5)  # cosine between [1, 1] and [1, 0]
T = 2 * C / (1 + C)  # N·cos / (1 + (N−1)·cos) with N = 2


def test_model_stock_interpolates_by_agreement(merge: Merge) -> None:
    base = torch.tensor([1.0, 1.0])
    out = merge("model_stock", [base, base + torch.tensor([1.0, 1.0]), base + torch.tensor([1.0, 0.0])], base=0)
    # t·mean + (1 − t)·base with mean = [2, 1.5]
    assert_close(out, T * torch.tensor([2.0, 1.5]) + (1 - T) * base, rtol=1e-6, atol=0)


def test_model_stock_opposing_updates_keep_the_base(merge: Merge) -> None:
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    update = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = merge("model_stock", [base, base + update, base - update], base=0)  # cos = −1: singular
    assert torch.equal(out, base)


def test_model_stock_filter_wise_uses_one_cosine_per_row(merge: Merge) -> None:
    base = torch.zeros(2, 2)
    a = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    out = merge("model_stock", [base, a, b], base=0, params={"filter_wise": True})
    # row 0 agrees (cos = 1/√2); row 1 is orthogonal (cos = 0 → t = 0 → base)
    assert_close(out, torch.tensor([[T, T * 0.5], [0.0, 0.0]]), rtol=1e-6, atol=0)


def test_model_stock_needs_two_other_models(merge: Merge) -> None:
    with pytest.raises(ValueError, match="at least two"):
        merge("model_stock", [torch.ones(2), torch.zeros(2)], base=0)


def test_model_stock_of_identical_fine_tunes_is_that_model(merge: Merge) -> None:
    base = torch.zeros(3, 4)
    tuned = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    assert_close(merge("model_stock", [base, tuned, tuned, tuned], base=0), tuned, rtol=1e-6, atol=1e-7)

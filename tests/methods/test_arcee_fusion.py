"""``arcee_fusion``: hand-computed values and properties."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from resumerge.merge.methods import arcee_fusion

Merge = Callable[..., torch.Tensor]


def test_arcee_fusion_keeps_only_outlying_changes(merge: Merge) -> None:
    base = torch.zeros(9)
    delta = torch.tensor([0.1, -0.2, 0.3, 0.0, 0.0, 0.1, 5.0, 0.2, -0.1])
    out = merge("arcee_fusion", [base, base + delta], base=0)
    # one row, so importance ∝ |δ|: sorted 0 0 .1 .1 .1 .2 .2 .3 5 → q1 = .1, median = .1, q3 = .2;
    # threshold .1 + 1.5 · .1 = .25 keeps 0.3 and 5
    assert torch.equal(out, torch.tensor([0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0]))


def test_arcee_fusion_returns_float32_for_half_inputs_like_mergekit(merge: Merge) -> None:
    base = torch.zeros(2, 4, dtype=torch.bfloat16)
    other = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]], dtype=torch.bfloat16)
    assert merge("arcee_fusion", [base, other], base=0).dtype == torch.float32


def test_arcee_fusion_requires_a_generator(merge: Merge) -> None:
    with pytest.raises(ValueError, match="Generator"):
        merge("arcee_fusion", [torch.zeros(3), torch.ones(3)], base=0, seed=None)


def test_arcee_fusion_samples_large_tensors_from_the_generator(merge: Merge) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (arcee_fusion.QUANTILE_SAMPLE_SIZE // 1000 + 5, 1000)
    base, other = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    state = torch.get_rng_state()
    first = merge("arcee_fusion", [base, other], base=0, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, merge("arcee_fusion", [base, other], base=0, seed=1))

"""``multislerp`` and ``karcher`` (spherical means of many models): hand-computed values and properties."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from resumerge.merge.methods import get_method

Merge = Callable[..., torch.Tensor]


def test_multislerp_scales_the_weighted_mean_direction(merge: Merge) -> None:
    a = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    out = merge("multislerp", [a, b], per_model={"weight": [1.0, 3.0]})
    # weights → [1/4, 3/4]; mean direction ∝ [1/4, 3/4] = [1, 3]/√10; scale = 1/4·2 + 3/4·4 = 3.5
    expected = torch.tensor([[1.0, 3.0], [0.0, 0.0]]) / math.sqrt(10) * 3.5
    assert_close(out, expected, rtol=1e-6, atol=1e-7)


def test_multislerp_with_base_works_on_task_vectors(merge: Merge) -> None:
    base = torch.tensor([1.0, 1.0, 1.0])
    a = base + torch.tensor([1.0, 0.0, 0.0])
    b = base + torch.tensor([0.0, 1.0, 0.0])
    c = base + torch.tensor([0.0, 0.0, 1.0])
    out = merge("multislerp", [base, a, b, c], base=0, per_model={"weight": [None, 1.0, 1.0, 1.0]})
    assert_close(out, base + 1 / math.sqrt(3), rtol=1e-6, atol=0)


def test_multislerp_without_weight_normalisation_scales_by_the_raw_weights(merge: Merge) -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    out = merge("multislerp", [a, b], params={"normalize_weights": False}, per_model={"weight": [2.0, 2.0]})
    # direction [1, 1]/√2, scale 2·1 + 2·1
    assert_close(out, torch.tensor([4.0, 4.0]) / math.sqrt(2), rtol=1e-6, atol=0)


def test_multislerp_single_input_is_copied(merge: Merge) -> None:
    base, a = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    out = merge("multislerp", [base, a], base=0, per_model={"weight": [None, 0.3]})
    assert torch.equal(out, a)
    assert out.data_ptr() != a.data_ptr()


def test_multislerp_antipodal_pair_falls_back_to_the_weighted_sum(merge: Merge) -> None:
    a = torch.tensor([1.0, 2.0])
    out = merge("multislerp", [a, -a], per_model={"weight": [1.0, 1.0]})
    assert torch.equal(out, torch.zeros(2))


def test_multislerp_antipodal_triple_raises(merge: Merge) -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match="mean direction"):
        merge("multislerp", [a, -a, b, -b], per_model={"weight": [1.0] * 4})


def test_multislerp_check_rejects_weights_summing_to_zero() -> None:
    spec = get_method("multislerp")
    assert spec is not None and spec.check is not None
    assert spec.check({"normalize_weights": True}, [{}, {"weight": 1.0}, {"weight": -1.0}]) is not None
    assert spec.check({"normalize_weights": False}, [{}, {"weight": 1.0}, {"weight": -1.0}]) is None
    assert spec.check({"normalize_weights": True}, [{}, {"weight": 1.0}, {"weight": 2.0}]) is None


def test_karcher_of_orthogonal_tensors(merge: Merge) -> None:
    a = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    # Equal weights: the mean direction is [1, 1]/√2 (the tangents cancel), scaled by the mean norm 3.
    out = merge("karcher", [a, b])
    assert_close(out, torch.tensor([[3.0, 3.0], [0.0, 0.0]]) / math.sqrt(2), rtol=1e-6, atol=0)


def test_karcher_ignores_near_zero_inputs_in_the_direction(merge: Merge) -> None:
    a = torch.tensor([0.0, 3.0, 4.0])
    out = merge("karcher", [a, torch.zeros(3)])
    # direction of a alone, scaled by the mean norm (5 + 0)/2
    assert_close(out, a / 5 * 2.5, rtol=1e-6, atol=0)


def test_karcher_of_all_zero_inputs_is_zero(merge: Merge) -> None:
    assert torch.equal(merge("karcher", [torch.zeros(2, 2)] * 3), torch.zeros(2, 2))


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**16), copies=st.integers(2, 4))
def test_karcher_and_multislerp_of_identical_inputs_return_that_input(merge: Merge, seed: int, copies: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    assert_close(merge("karcher", [x] * copies), x, rtol=1e-5, atol=1e-6)
    out = merge("multislerp", [x] * copies, per_model={"weight": [1.0] * copies})
    assert_close(out, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_multislerp_of_unchanged_tensors_is_the_base(merge: Merge, dtype: torch.dtype) -> None:
    # mergekit 0.1.5 raises here (float32/bfloat16) or returns NaN (float16): a tensor no fine-tune changed.
    base = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = merge("multislerp", [base] * 4, base=0, per_model={"weight": [None, 0.2, 0.3, 0.5]})
    assert torch.equal(out, base)


def test_multislerp_in_float16_stays_finite_for_one_shared_direction(merge: Merge) -> None:
    # eps = 1e-8 is 0 in float16, so mergekit divides sin(0) by 0 when the tangent vanishes.
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    out = merge("multislerp", [x, x], per_model={"weight": [1.0, 1.0]})
    torch.testing.assert_close(out, x, rtol=2e-3, atol=2e-3)
    base = torch.zeros(4, 4, dtype=torch.float16)
    out = merge("multislerp", [base, base, x], base=0, per_model={"weight": [None, 1.0, 1.0]})
    assert bool(torch.isfinite(out).all())

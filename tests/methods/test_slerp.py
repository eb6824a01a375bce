"""``slerp`` and ``nuslerp``: hand-computed values and properties."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

Merge = Callable[..., torch.Tensor]
R2 = math.sqrt(0.5)  # sin(π/4)


def test_slerp_of_orthogonal_tensors_uses_the_raw_tensors(merge: Merge) -> None:
    base = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    other = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    # Ω = π/2, so both coefficients are sin(π/4) / sin(π/2) and apply to the unnormalised tensors.
    out = merge("slerp", [base, other], base=0, params={"t": 0.5})
    assert_close(out, torch.tensor([[2 * R2, 3 * R2, 0.0], [0.0, 0.0, 0.0]]), rtol=1e-6, atol=0)


def test_slerp_of_collinear_tensors_is_lerp(merge: Merge) -> None:
    base = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = merge("slerp", [2 * base, base], base=1, params={"t": 0.25})
    assert torch.equal(out, 1.25 * base)


def test_slerp_treats_a_zero_base_as_a_unit_norm(merge: Merge) -> None:
    # |B| ≤ 1e-8 counts as 1, so cos Ω = 0 and the other tensor gets sin(tπ/2), not t.
    other = torch.tensor([[1.0, -2.0, 4.0]])
    out = merge("slerp", [torch.zeros(1, 3), other], base=0, params={"t": 0.5})
    assert_close(out, R2 * other, rtol=1e-6, atol=0)


def test_slerp_keeps_half_precision_dtype(merge: Merge) -> None:
    base = torch.tensor([1.0, 0.0], dtype=torch.bfloat16)
    other = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    out = merge("slerp", [base, other], base=0, params={"t": 0.5})
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor([R2, R2]).to(torch.bfloat16))


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(3,), (2, 3), (4, 1, 5)]),
    base_index=st.sampled_from([0, 1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_slerp_endpoints_are_exact(
    merge: Merge, seed: int, shape: tuple[int, ...], base_index: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = list(torch.randn(2, *shape, generator=gen).to(dtype))
    base, other = tensors[base_index], tensors[1 - base_index]
    assert torch.equal(merge("slerp", tensors, base=base_index, params={"t": 0.0}), base)
    assert torch.equal(merge("slerp", tensors, base=base_index, params={"t": 1.0}), other)


def test_slerp_rejects_a_third_input(merge: Merge) -> None:
    with pytest.raises(ValueError, match="exactly one other"):
        merge("slerp", [torch.ones(2)] * 3, base=0, params={"t": 0.5})


def test_nuslerp_weights_set_t_and_flatten_by_default(merge: Merge) -> None:
    v0 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    v1 = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    out = merge("nuslerp", [v0, v1], per_model={"weight": [1.0, 3.0]})  # t = 3/4, Ω = π/2
    expected = torch.tensor([[math.sin(math.pi / 8), 0.0, 0.0], [0.0, math.sin(3 * math.pi / 8), 0.0]])
    assert_close(out, expected, rtol=1e-6, atol=1e-7)


def test_nuslerp_with_a_base_slerps_task_vectors(merge: Merge) -> None:
    base = torch.full((2, 3), 5.0)
    v0 = base + torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    v1 = base + torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    out = merge("nuslerp", [v0, base, v1], base=1, per_model={"weight": [1.0, None, 1.0]})
    assert_close(out, base + torch.tensor([[R2, 0.0, 0.0], [0.0, R2, 0.0]]), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # flatten: cos Ω = 1/2, so Ω = π/3 and both coefficients are sin(π/6)/sin(π/3) = 1/√3
        ({}, [[1 / math.sqrt(3), 1 / math.sqrt(3)], [2 / math.sqrt(3), 0.0]]),
        # per row: row 0 orthogonal (sin(π/4) each), row 1 identical (lerp)
        ({"nuslerp_flatten": False}, [[R2, R2], [1.0, 0.0]]),
        # per column: column 0 at Ω = π/4, sin(π/8)/sin(π/4)·([1,1]+[0,1]); column 1 from a zero vector
        (
            {"nuslerp_flatten": False, "nuslerp_row_wise": True},
            [[math.sin(math.pi / 8) / R2, R2], [2 * math.sin(math.pi / 8) / R2, 0.0]],
        ),
    ],
)
def test_nuslerp_flatten_and_row_wise(merge: Merge, params: dict[str, bool], expected: list[list[float]]) -> None:
    v0 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    v1 = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    out = merge("nuslerp", [v0, v1], params=params, per_model={"weight": [1.0, 1.0]})
    assert_close(out, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_nuslerp_weights_summing_to_zero_mean_halfway(merge: Merge) -> None:
    v0, v1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    out = merge("nuslerp", [v0, v1], per_model={"weight": [1.0, -1.0]})
    assert_close(out, torch.tensor([R2, R2]), rtol=1e-6, atol=0)


def test_nuslerp_needs_two_non_base_inputs(merge: Merge) -> None:
    with pytest.raises(ValueError, match="exactly two non-base"):
        merge("nuslerp", [torch.ones(2)] * 3, per_model={"weight": [1.0] * 3})

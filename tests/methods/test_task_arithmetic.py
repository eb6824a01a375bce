"""The task-arithmetic family: task_arithmetic, ties, dare_*, breadcrumbs*, della*."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from resumerge.merge.methods import get_method

Merge = Callable[..., torch.Tensor]
FAMILY = [
    "task_arithmetic",
    "ties",
    "dare_ties",
    "dare_linear",
    "breadcrumbs",
    "breadcrumbs_ties",
    "della",
    "della_linear",
]
RANDOMIZED = ["dare_ties", "dare_linear", "della", "della_linear"]

BASE = torch.ones(2, 3)
D1 = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.0, 0.0]])
D2 = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 4.0]])
# sparsification example: no ties among magnitudes at the cut-offs
S1 = torch.tensor([[3.0, -1.0, 0.5], [2.0, 0.0, -4.0]])
S2 = torch.tensor([[1.5, 2.0, -3.0], [-0.5, 1.0, 4.0]])


def weights(*values: float) -> dict[str, list[float | None]]:
    return {"weight": [None, *values]}


def test_task_arithmetic_adds_weighted_deltas(merge: Merge) -> None:
    out = merge("task_arithmetic", [BASE, BASE + D1, BASE + D2], base=0, per_model=weights(0.5, 1.0))
    assert torch.equal(out, torch.tensor([[2.5, 2.0, 1.5], [0.0, 1.0, 5.0]]))


def test_task_arithmetic_lambda_and_normalize(merge: Merge) -> None:
    tensors = [BASE, BASE + D1, BASE + D2]
    out = merge("task_arithmetic", tensors, base=0, params={"lambda": 2.0}, per_model=weights(0.5, 1.0))
    assert torch.equal(out, torch.tensor([[4.0, 3.0, 2.0], [-1.0, 1.0, 9.0]]))
    out = merge("task_arithmetic", tensors, base=0, params={"normalize": True}, per_model=weights(0.5, 1.0))
    assert_close(out, 1 + torch.tensor([[1.5, 1.0, 0.5], [-1.0, 0.0, 4.0]]) / 1.5, rtol=1e-6, atol=0)


def test_task_arithmetic_rounds_weights_to_the_input_dtype(merge: Merge) -> None:
    base = torch.zeros(3, dtype=torch.bfloat16)
    out = merge("task_arithmetic", [base, base + 1], base=0, per_model=weights(0.3))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((3,), 0.30078125, dtype=torch.bfloat16))  # bf16(0.3), exactly


def test_ties_elects_signs_and_normalizes_by_agreeing_weights(merge: Merge) -> None:
    out = merge("ties", [BASE, BASE + D1, BASE + D2], base=0, per_model=weights(0.5, 1.0))
    # weighted deltas [[.5,0,-.5],[1,0,0]] and D2; elected signs + + + − + +; zeros never agree
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 2.0], [-1.0, 1.0, 5.0]]))


def test_ties_density_keeps_the_top_magnitudes(merge: Merge) -> None:
    base = torch.full((2, 3), 10.0)
    out = merge(
        "ties", [base, base + S1, base + S2], base=0, per_model={**weights(1.0, 1.0), "density": [None, 0.5, 0.5]}
    )
    # top 3 of S1: 3, 2, −4; of S2: 2, −3, 4; then −4 loses the sign election at [1, 2]
    assert torch.equal(out, base + torch.tensor([[3.0, 2.0, -3.0], [2.0, 0.0, 4.0]]))


def test_int8_mask_does_not_change_the_result(merge: Merge) -> None:
    tensors = [BASE, BASE + S1, BASE + S2]
    per_model = {**weights(0.7, 0.4), "density": [None, 0.5, 0.8]}
    plain = merge("ties", tensors, base=0, per_model=per_model)
    assert torch.equal(plain, merge("ties", tensors, base=0, params={"int8_mask": True}, per_model=per_model))


BREADCRUMBS = {**weights(1.0, 1.0), "density": [None, 0.5, 0.5], "gamma": [None, 0.2, 0.2]}


def test_breadcrumbs_drops_outliers_and_small_entries(merge: Merge) -> None:
    out = merge("breadcrumbs", [BASE, BASE + S1, BASE + S2], base=0, per_model=BREADCRUMBS)
    # S1 keeps 3, −1, 2 (−4 is the outlier); S2 keeps 1.5, 2, −3 (4 is the outlier)
    assert torch.equal(out, BASE + torch.tensor([[4.5, 1.0, -3.0], [2.0, 0.0, 0.0]]))


def test_breadcrumbs_ties_adds_the_sign_election(merge: Merge) -> None:
    out = merge("breadcrumbs_ties", [BASE, BASE + S1, BASE + S2], base=0, per_model=BREADCRUMBS)
    # the −1 of S1 at [0, 1] disagrees with the elected + and is erased; no normalisation by default
    assert torch.equal(out, BASE + torch.tensor([[4.5, 2.0, -3.0], [2.0, 0.0, 0.0]]))


@pytest.mark.parametrize("method", FAMILY)
def test_only_a_base_gives_a_copy_of_it(merge: Merge, method: str) -> None:
    out = merge(method, [BASE], base=0)
    assert torch.equal(out, BASE)
    assert out.data_ptr() != BASE.data_ptr()


@settings(deadline=None, max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    method=st.sampled_from(FAMILY),
    n=st.integers(1, 3),
    weight=st.floats(-2, 2),
    density=st.floats(0.3, 0.7),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_zero_deltas_return_the_base(
    merge: Merge, seed: int, method: str, n: int, weight: float, density: float, dtype: torch.dtype
) -> None:
    base = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)).to(dtype)
    per_model = {"weight": [None] + [weight] * n, "density": [None] + [density] * n}
    out = merge(method, [base] * (n + 1), base=0, params={"lambda": 1.5}, per_model=per_model)
    assert torch.equal(out, base)


@settings(deadline=None, max_examples=30)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 3),
    normalize=st.booleans(),
    sign=st.sampled_from([1.0, -1.0]),
)
def test_ties_at_density_one_with_agreeing_signs_is_task_arithmetic(
    merge: Merge, seed: int, n: int, normalize: bool, sign: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(3, 4, generator=gen)
    # strictly one-signed deltas (zeros would be excluded from the TIES divisor) and positive weights
    tensors = [base] + [base + sign * (0.1 + torch.rand(3, 4, generator=gen)) for _ in range(n)]
    per_model = {"weight": [None, *(0.2 + torch.rand(n, generator=gen)).tolist()]}
    params = {"normalize": normalize}
    ties = merge("ties", tensors, base=0, params=params, per_model=per_model)
    assert_close(ties, merge("task_arithmetic", tensors, base=0, params=params, per_model=per_model))


def test_dare_keep_rate_and_l1_rescale(merge: Merge) -> None:
    base = torch.zeros(100_000)
    out = merge("dare_linear", [base, base + 1], base=0, per_model={**weights(1.0), "density": [None, 0.25]})
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.25) < 0.01
    assert out.sum().item() == pytest.approx(100_000, rel=1e-4)  # L1 of the delta preserved


@pytest.mark.parametrize("method", RANDOMIZED)
def test_randomized_members_are_deterministic_per_seed_and_order_free(merge: Merge, method: str) -> None:
    gen = torch.Generator().manual_seed(5)
    first = [torch.randn(6, 8, generator=gen) for _ in range(3)]
    second = [torch.randn(4, 4, generator=gen) for _ in range(3)]
    per_model = {**weights(0.6, 0.4), "density": [None, 0.5, 0.4]}
    a = merge(method, first, base=0, per_model=per_model, seed=11)
    merge(method, second, base=0, per_model=per_model, seed=12)
    assert torch.equal(a, merge(method, first, base=0, per_model=per_model, seed=11))
    assert not torch.equal(a, merge(method, first, base=0, per_model=per_model, seed=13))


@pytest.mark.parametrize("method", RANDOMIZED)
def test_randomized_members_refuse_to_run_without_a_generator(merge: Merge, method: str) -> None:
    with pytest.raises(ValueError, match="Generator"):
        merge(method, [BASE, BASE + D1], base=0, per_model=weights(1.0), seed=None)


def test_della_epsilon_check_matches_the_runtime_error(merge: Merge) -> None:
    spec = get_method("della")
    assert spec is not None and spec.check is not None
    bad = [{}, {"weight": 1.0, "density": 0.9, "epsilon": 0.15}]
    assert "density ± epsilon" in (spec.check({}, bad) or "")
    assert spec.check({}, [{}, {"weight": 1.0, "density": 0.5, "epsilon": 0.15}]) is None
    assert spec.check({}, [{}, {"weight": 1.0, "density": 1.0, "epsilon": 0.15}]) is None  # no pruning
    with pytest.raises(ValueError, match="epsilon"):
        merge("della", [BASE, BASE + D1], base=0, per_model={**weights(1.0), "density": [None, 0.9]})


@pytest.mark.parametrize("method", FAMILY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combining_block_by_block_gives_the_whole_tensors_bits(
    merge: Merge, monkeypatch: pytest.MonkeyPatch, method: str, dtype: torch.dtype
) -> None:
    # The weighted, elected and normalised sum runs over blocks of positions; no block size may change a bit,
    # including blocks that end inside a row and a last block shorter than the others.
    from resumerge.merge.methods import task_vectors

    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(13, 29, generator=gen).to(dtype) for _ in range(4)]
    per_model = {"weight": [None, 0.5, -0.3, 0.9], "density": [None, 0.6, 0.4, 0.7]}
    params = {"normalize": True, "lambda": 0.7}
    whole = merge(method, tensors, base=0, per_model=per_model, params=params, seed=5)
    monkeypatch.setattr(task_vectors, "_BLOCK_ENTRIES", 10)
    blocked = merge(method, tensors, base=0, per_model=per_model, params=params, seed=5)
    assert torch.equal(whole.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       blocked.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))

"""Contracts of every registered method (mergekit's 20 and those beyond it): declarations, purity, RNG use, chunking."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumerge.merge.methods import BasePolicy, MethodSpec, Scope, get_method, method_names

Merge = Callable[..., torch.Tensor]
G, P, N = Scope.GLOBAL, Scope.PER_MODEL, Scope.NON_BASE
REQ, OPT, IGN = BasePolicy.REQUIRED, BasePolicy.OPTIONAL, BasePolicy.IGNORED
GTA = {"int8_mask": G, "normalize": G, "rescale": G, "lambda": G, "weight": N, "density": N}

# method: (parameter scopes, base policy, min inputs, max inputs, elementwise, randomized)
EXPECTED: dict[str, tuple[dict[str, Scope], BasePolicy, int, int | None, bool, bool]] = {
    "linear": ({"weight": P, "normalize": G}, IGN, 1, None, True, False),
    "passthrough": ({"scale": P}, IGN, 1, 1, True, False),
    "slerp": ({"t": G}, REQ, 2, 2, False, False),
    "nuslerp": ({"weight": N, "nuslerp_row_wise": G, "nuslerp_flatten": G}, OPT, 2, 3, False, False),
    "multislerp": ({"weight": N, "normalize_weights": G, "eps": G}, OPT, 1, None, False, False),
    "karcher": ({"max_iter": G, "tol": G}, IGN, 1, None, False, False),
    "task_arithmetic": (GTA, REQ, 1, None, True, False),
    "ties": (GTA, REQ, 1, None, False, False),
    "dare_ties": (GTA, REQ, 1, None, False, True),
    "dare_linear": (GTA, REQ, 1, None, False, True),
    "breadcrumbs": ({**GTA, "gamma": N}, REQ, 1, None, False, False),
    "breadcrumbs_ties": ({**GTA, "gamma": N}, REQ, 1, None, False, False),
    "della": ({**GTA, "epsilon": N}, REQ, 1, None, False, True),
    "della_linear": ({**GTA, "epsilon": N}, REQ, 1, None, False, True),
    "sce": ({"int8_mask": G, "select_topk": G}, REQ, 1, None, False, False),
    "ram": ({"epsilon": G}, REQ, 1, None, True, False),
    "ramplus_tl": ({"r": G, "alpha": G, "epsilon": G}, REQ, 1, None, False, False),
    "model_stock": ({"filter_wise": G}, REQ, 3, None, False, False),
    "nearswap": ({"t": G}, REQ, 2, 2, True, False),
    "arcee_fusion": ({}, REQ, 2, 2, False, True),
    # Beyond mergekit (issue 59's SVD methods).
    "tsv": ({"scaling": G, "svd": G}, REQ, 2, None, False, False),
    "core_space": ({"scaling": G, "inner": G, "density": G}, REQ, 1, None, False, False),
    "iso_c": ({"scaling": G, "svd": G}, REQ, 2, None, False, False),
    "iso_cts": ({"scaling": G, "common_space_fraction": G, "svd": G}, REQ, 2, None, False, False),
    "regmean": ({"grams": G, "reduce_non_diagonal_ratio": G}, IGN, 1, None, False, False),
    "regmean_plus": ({"grams": G, "reduce_non_diagonal_ratio": G}, IGN, 1, None, False, False),
}

W3 = {"weight": [None, 0.5, 0.3, 0.4]}
# method: (input count, base index, global params, per-model params) for the generic tests below
CALLS: dict[str, tuple[int, int | None, dict[str, Any], dict[str, list[Any]]]] = {
    "linear": (3, None, {}, {"weight": [0.2, 0.5, 0.3]}),
    "passthrough": (1, None, {}, {"scale": [0.5]}),
    "slerp": (2, 1, {"t": 0.3}, {}),
    "nuslerp": (3, 0, {}, {"weight": [None, 0.4, 0.6]}),
    "multislerp": (4, 0, {}, W3),
    "karcher": (3, None, {}, {}),
    "task_arithmetic": (4, 0, {"lambda": 0.8}, W3),
    "ties": (4, 0, {}, {**W3, "density": [None, 0.5, 0.3, 0.6]}),
    "dare_ties": (4, 0, {}, {**W3, "density": [None, 0.5, 0.3, 0.6]}),
    "dare_linear": (4, 0, {}, {**W3, "density": [None, 0.5, 0.3, 0.6]}),
    "breadcrumbs": (4, 0, {}, {**W3, "density": [None, 0.5, 0.3, 0.6], "gamma": [None, 0.1, 0.05, 0.2]}),
    "breadcrumbs_ties": (4, 0, {}, {**W3, "density": [None, 0.5, 0.3, 0.6], "gamma": [None, 0.1, 0.05, 0.2]}),
    "della": (4, 0, {}, {**W3, "density": [None, 0.5, 0.4, 0.6], "epsilon": [None, 0.1, 0.2, 0.15]}),
    "della_linear": (4, 0, {}, {**W3, "density": [None, 0.5, 0.4, 0.6], "epsilon": [None, 0.1, 0.2, 0.15]}),
    "sce": (4, 0, {"select_topk": 0.5}, {}),
    "ram": (4, 0, {}, {}),
    "ramplus_tl": (4, 0, {}, {}),
    "model_stock": (4, 0, {"filter_wise": False}, {}),
    "nearswap": (2, 0, {"t": 0.05}, {}),
    "arcee_fusion": (2, 0, {}, {}),
    "tsv": (4, 0, {"scaling": 0.8}, {}),
    "core_space": (4, 0, {"scaling": 0.8}, {}),
    "iso_c": (4, 0, {"scaling": 0.8}, {}),
    "iso_cts": (4, 0, {"common_space_fraction": 0.7}, {}),
    # Without Grams among its inputs (the planner adds them), regmean is the plain mean.
    "regmean": (3, None, {"grams": "unused"}, {}),
    "regmean_plus": (3, None, {"grams": "unused"}, {}),
}


def spec(name: str) -> MethodSpec:
    found = get_method(name)
    assert found is not None, name
    return found


def inputs(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    count, base, _, _ = CALLS[name]
    gen = torch.Generator().manual_seed(seed)
    center = torch.randn(shape, generator=gen)
    return [(center if i == base else center + 0.1 * torch.randn(shape, generator=gen)).to(dtype) for i in range(count)]


def run(merge: Merge, name: str, tensors: list[torch.Tensor], seed: int | None = 0) -> torch.Tensor:
    _, base, params, per_model = CALLS[name]
    return merge(name, tensors, base=base, params=params, per_model=per_model, seed=seed)


def test_every_registered_method_is_declared_here() -> None:
    assert sorted(EXPECTED) == method_names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_declared_contract(name: str) -> None:
    scopes, base, min_inputs, max_inputs, elementwise, randomized = EXPECTED[name]
    s = spec(name)
    assert {p.name: p.scope for p in s.params} == scopes
    assert (s.base, s.min_inputs, s.max_inputs) == (base, min_inputs, max_inputs)
    assert (s.elementwise, s.randomized) == (elementwise, randomized)
    for p in s.params:
        assert not (p.required and p.default is not None), p.name
        if p.default is not None and p.minimum is not None:
            assert p.default > p.minimum if p.exclusive_min else p.default >= p.minimum, p.name
        if p.default is not None and p.maximum is not None:
            assert p.default <= p.maximum, p.name
    if s.base is BasePolicy.IGNORED:
        assert all(p.scope is not Scope.NON_BASE for p in s.params)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 7), (6,), (2, 3, 4), ()])
def test_pure_finite_fresh_and_rng_free(merge: Merge, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensors = inputs(name, shape, dtype, seed=1)
    before = [x.clone() for x in tensors]
    rng = torch.get_rng_state()
    out = run(merge, name, tensors)
    assert torch.equal(torch.get_rng_state(), rng), "touched the global RNG"
    assert all(torch.equal(x, y) for x, y in zip(tensors, before, strict=True)), "mutated an input"
    assert out.shape == tensors[0].shape
    assert out.is_floating_point() and bool(torch.isfinite(out).all())
    assert all(out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for x in tensors)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero", [False, True], ids=["random", "zero"])
def test_identical_inputs_give_finite_results(merge: Merge, name: str, dtype: torch.dtype, zero: bool) -> None:
    # e.g. a tensor no fine-tune changed; mergekit's multislerp fails on it (see test_multislerp.py)
    x = torch.zeros(5, 7) if zero else torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    out = run(merge, name, [x.to(dtype)] * CALLS[name][0])
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_empty_tensors_give_empty_results(merge: Merge, name: str) -> None:
    tensors = inputs(name, (0, 4), torch.bfloat16, seed=0)
    assert run(merge, name, tensors).shape == (0, 4)


@pytest.mark.parametrize("name", [n for n in sorted(EXPECTED) if EXPECTED[n][5]])
def test_randomized_methods_refuse_to_run_without_a_generator(merge: Merge, name: str) -> None:
    with pytest.raises(ValueError, match="Generator"):
        run(merge, name, inputs(name, (4, 4), torch.float32, 0), seed=None)


@pytest.mark.parametrize("name", [n for n in sorted(EXPECTED) if not EXPECTED[n][5]])
def test_deterministic_methods_need_no_generator(merge: Merge, name: str) -> None:
    tensors = inputs(name, (4, 4), torch.float32, 0)
    assert torch.equal(run(merge, name, tensors, seed=None), run(merge, name, tensors, seed=3))


@pytest.mark.parametrize("name", [n for n in sorted(EXPECTED) if EXPECTED[n][5]])
def test_randomized_methods_depend_only_on_the_seed(merge: Merge, name: str) -> None:
    a = inputs(name, (16, 16), torch.float32, 0)
    b = inputs(name, (8, 4), torch.float32, 1)
    first = run(merge, name, a, seed=42)
    run(merge, name, b, seed=43)  # another tensor in between, as in any execution order
    assert torch.equal(first, run(merge, name, a, seed=42))


@settings(deadline=None, max_examples=40)
@given(
    name=st.sampled_from([n for n in sorted(EXPECTED) if EXPECTED[n][4]]),
    seed=st.integers(0, 2**16),
    rows=st.integers(2, 9),
    cut=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_elementwise_methods_give_the_same_result_on_row_chunks(
    merge: Merge, name: str, seed: int, rows: int, cut: int, dtype: torch.dtype
) -> None:
    cut = min(cut, rows - 1)
    tensors = inputs(name, (rows, 5), dtype, seed)
    whole = run(merge, name, tensors)
    top = run(merge, name, [x[:cut] for x in tensors])
    bottom = run(merge, name, [x[cut:] for x in tensors])
    assert torch.equal(whole, torch.cat([top, bottom]))

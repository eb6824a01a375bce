"""``ram`` and ``ramplus_tl``: hand-computed values, properties, and the bits of the plain whole-tensor expression.

The blocked implementation must give exactly what the whole-tensor expression gives (kept below as the
reference: resumerge's code before the rewrite, mergekit's expression): same dtype, same bits at every non-NaN
position (signed zeros included), NaN at the same positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from resumerge.merge.methods import MergeContext, ram

Merge = Callable[..., torch.Tensor]

BASE = torch.zeros(2, 3)
# with epsilon 0.5: model 1 touches [0,0] [0,2] [1,1] [1,2]; model 2 touches [0,0] [1,1] [1,2]
D1 = torch.tensor([[1.0, 0.1, 2.0], [0.0, 3.0, -1.0]])
D2 = torch.tensor([[3.0, 0.0, 0.2], [0.0, 1.0, 1.0]])

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]


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


# --- the reference: the whole-tensor expression, as resumerge computed it before running in blocks ---


def _reference_touched(ctx: MergeContext, epsilon: float) -> tuple[torch.Tensor, ...]:
    base = ctx.base
    others = ctx.others()
    deltas = torch.stack([ctx.tensors[i] - base for i in others], dim=0).view(len(others), -1)
    touched = deltas.abs() > epsilon
    counts = touched.sum(dim=0, keepdim=True)
    return deltas * touched, touched, counts, counts > 1, counts == 1


def reference_ram(ctx: MergeContext) -> torch.Tensor:
    base = ctx.base
    if not ctx.others():
        return base.clone()
    deltas, _, counts, shared, unique = _reference_touched(ctx, float(ctx.params.get("epsilon", 1e-5)))
    merged = (deltas * unique + deltas * shared / counts.clamp(min=1)).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def reference_ramplus_tl(ctx: MergeContext) -> torch.Tensor:
    base = ctx.base
    if not ctx.others():
        return base.clone()
    epsilon = float(ctx.params.get("epsilon", 1e-5))
    r = float(ctx.params.get("r", 0.1))
    alpha = float(ctx.params.get("alpha", 0.2))
    deltas, touched, counts, shared, unique = _reference_touched(ctx, epsilon)
    shared_count = (touched & shared).sum(dim=1)
    unique_count = (touched & unique).sum(dim=1)
    rho = shared_count / unique_count.clamp(min=epsilon)
    amplify = 1 + r * rho.clamp(min=0, max=alpha)
    merged = (deltas * unique * amplify.unsqueeze(-1) + deltas * shared / counts.clamp(min=1)).sum(
        dim=0, keepdim=True
    )
    return base + merged.reshape_as(base)


REFERENCES = {"ram": reference_ram, "ramplus_tl": reference_ramplus_tl}
METHODS = {"ram": ram.ram, "ramplus_tl": ram.ramplus_tl}
SPECS = {"ram": ram.SPEC, "ramplus_tl": ram.SPEC_PLUS}


def _context(method: str, tensors: list[torch.Tensor], params: Mapping[str, Any]) -> MergeContext:
    """The context the engine gives ``method``: base first, its defaults bound as the planner binds them."""
    return MergeContext(tensors, 0, *SPECS[method].bind([{} for _ in tensors], params, 0))


def _assert_same_bits(got: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, label
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan), f"{label}: NaN at other positions"
    bits = BITS[got.dtype]
    differ = got[~nan].contiguous().view(bits) != expected[~nan].contiguous().view(bits)
    assert not bool(differ.any()), f"{label}: {int(differ.sum())} of {int((~nan).sum())} positions differ"


def _check(method: str, tensors: list[torch.Tensor], params: Mapping[str, Any], label: str) -> None:
    ctx = _context(method, tensors, params)
    _assert_same_bits(METHODS[method](ctx), REFERENCES[method](ctx), f"{method} {label} {dict(params)}")


def _inputs(shape: tuple[int, ...], models: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """A base and fine-tunes of it with every edge case: deltas of ±ε exactly (|δ| = ε is not a touch), tiny
    and huge ones, untouched entries, ±0, ±inf and NaN in base and models, positions every model touches and
    positions none touches."""
    gen = torch.Generator().manual_seed(seed)
    size = max(1, int(torch.tensor(shape).prod()))
    base = torch.randn(size, generator=gen)
    tensors = [base]
    for _ in range(models):
        scale = torch.logspace(-7, 1, size)[torch.randperm(size, generator=gen)]
        delta = torch.randn(size, generator=gen) * scale * (torch.rand(size, generator=gen) < 0.7)
        tensors.append(base + delta)
    flat = [t.to(dtype) for t in tensors]
    if size >= 40:
        picks = torch.randperm(size, generator=gen)
        edge = picks[:16].tolist()
        for i, place in enumerate(edge[:8]):  # |δ| exactly epsilon, and just above
            flat[0][place] = 0.0
            for model in flat[1:]:
                model[place] = [1e-5, -1e-5, 0.5, -0.5][i % 4] * (1 if i < 4 else 1.001)
        for model in flat[1:]:  # every model touches one position, none touches another
            model[edge[8]] = flat[0][edge[8]] + 1.0
            model[edge[9]] = flat[0][edge[9]]
        for model in flat:  # signed zeros everywhere at one position, mixed at another
            model[edge[10]] = -0.0
        flat[0][edge[11]] = -0.0
        specials = picks[16 : 16 + 4 * len(SPECIALS)].view(4, -1)
        for row, model in zip(specials, flat[:4], strict=False):
            model[row] = torch.tensor(SPECIALS, dtype=dtype)
    return [t.view(shape) for t in flat]


PARAMS: list[dict[str, float]] = [{}, {"epsilon": 0.5, "r": 0.5, "alpha": 1.0}, {"epsilon": 0.0, "r": -0.3}]


@contextmanager
def _grain(elements: int) -> Iterator[None]:
    """Small blocks, so that small tensors span many blocks and a remainder joins the last one."""
    saved = ram._GRAIN
    ram._GRAIN = elements
    try:
        yield
    finally:
        ram._GRAIN = saved


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("models", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocked_merge_gives_the_reference_bits(method: str, models: int, dtype: torch.dtype) -> None:
    for shape, grain in [((), 2048), ((1,), 2048), ((7,), 2048), ((3, 37), 2048), ((61, 67), 2048), ((1000,), 512)]:
        for seed, params in enumerate(PARAMS):
            with _grain(grain):
                _check(method, _inputs(shape, models, dtype, seed), params, f"{shape} ×{models} {dtype}")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_tensors_larger_than_a_block_at_the_real_block_size(method: str) -> None:
    for models, dtype in [(1, torch.float32), (2, torch.bfloat16), (3, torch.float16)]:
        # 33 999 positions: two or more blocks of the real width, plus a remainder
        _check(method, _inputs((3, 11333), models, dtype, seed=models), {}, f"×{models} {dtype}")


@pytest.mark.parametrize("models", [5, 6, 17])
def test_many_models_sum_in_torchs_order(models: int) -> None:
    # Beyond four rows torch.sum's order depends on where a column falls in its vectorised loop: blocks aligned
    # to its column groups must give the whole tensor's order, tail columns included.
    cases = [((3, 37), 2048), ((1000,), 4096), ((1430,), 4096), ((2100,), 32768)]
    for dtype, (shape, grain), method in itertools.product([torch.float32, torch.bfloat16], cases, METHODS):
        with _grain(grain):
            _check(method, _inputs(shape, models, dtype, seed=models), {}, f"{shape} ×{models} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_models_order_shows_in_every_column(dtype: torch.dtype) -> None:
    # Terms 2²⁰, 2⁻⁵, 2⁻⁵, 2⁻⁵, -2²⁰ (five models all touching a zero base, δ = 5·term): adding left to right
    # gives 0 (2²⁰ + 2⁻⁵ rounds to 2²⁰), torch's four-way interleaved order, which it uses for some tail
    # columns, gives 3·2⁻⁵. Block remainders of every kind must keep each column's order.
    column = torch.tensor([5 * 2.0**20, 5 * 2.0**-5, 5 * 2.0**-5, 5 * 2.0**-5, -5 * 2.0**20])
    with _grain(4096):  # blocks of 704 positions for five models
        for positions in [704 * 2 + r for r in (5, 10, 22, 40, 63, 64, 100)]:
            deltas = column.unsqueeze(1).expand(5, positions).to(dtype)
            tensors = [torch.zeros(positions, dtype=dtype), *deltas.unbind(0)]
            for method in METHODS:
                _check(method, tensors, {}, f"{positions} positions of {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_half_precision_delta_against_epsilon(dtype: torch.dtype) -> None:
    # All 65 536 bit patterns as one model's delta from a zero base (another model's deltas are the patterns
    # rotated, so shared and unique positions mix), against thresholds that fall on, between and beyond
    # representable values: the touched test and the arithmetic after it match the reference everywhere.
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    base = torch.zeros_like(patterns)
    tensors = [base, patterns, patterns.roll(12345)]
    for epsilon in [1e-5, 0.0, 0.5, 2.0**-14, 1e-3, 1e38, float("inf"), float("nan")]:
        for method in METHODS:
            _check(method, tensors, {"epsilon": epsilon}, f"all {dtype} patterns")


def test_signed_zeros_match_the_reference() -> None:
    # The reference's sum starts from +0: a base of -0 with only zero (or untouched) deltas gives +0, never -0.
    values = [0.0, -0.0, 1e-45, -1e-45, 1e-6, -1e-6]
    combos = torch.tensor(list(itertools.product(values, repeat=3))).T.contiguous()
    for dtype in DTYPES:
        tensors = [row.to(dtype) for row in combos]
        for method, epsilon in itertools.product(METHODS, [0.0, 1e-5, -1.0]):
            _check(method, tensors, {"epsilon": epsilon}, f"zeros {dtype}")
        out = ram.ram(_context("ram", tensors, {}))
        assert not bool(torch.signbit(out[out == 0]).any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fold_is_torch_sum(dtype: torch.dtype) -> None:
    # Every combination of special and ordinary values down up to four rows, summed by _fold and by torch.sum.
    values = [0.0, -0.0, 1.0, -1.0, 3.0e-39, float("inf"), float("-inf"), float("nan"), 1 / 3, 65504.0]
    for rows in range(1, 5):
        terms = torch.tensor(list(itertools.product(values, repeat=rows))).T.contiguous().to(dtype)
        wide = torch.empty(terms.shape, dtype=torch.float32)
        got = ram._fold(terms, terms.unbind(0), torch.empty(terms.shape[1], dtype=dtype), (wide, wide.unbind(0)))
        _assert_same_bits(got, torch.sum(terms, dim=0), f"{rows} rows of {dtype}")


UNUSUAL = [{"r": float("inf")}, {"r": float("nan")}, {"r": -5.0}, {"epsilon": 1e-45, "alpha": float("inf")}]


@pytest.mark.parametrize("params", UNUSUAL)
def test_ramplus_with_unusual_amplification(params: dict[str, float]) -> None:
    # λ = inf, NaN or 0, and ρ = inf: the reference's ±0·λ products decide which positions turn NaN.
    for dtype in [torch.float32, torch.bfloat16, torch.float64]:
        _check("ramplus_tl", _inputs((9, 31), 3, dtype, seed=4), params, str(dtype))


def _peak_bytes(call: Callable[[], torch.Tensor]) -> int:
    """Peak bytes allocated through torch during ``call`` (its result included), from the profiler's record."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
        del result
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("method", sorted(METHODS))
def test_working_memory_is_the_result_and_a_few_blocks(method: str) -> None:
    tensors = _inputs((512, 1024), 3, torch.bfloat16, seed=0)
    ctx = _context(method, tensors, {})
    result_bytes = tensors[0].numel() * (2 if method == "ram" else 4)
    # Blocks stay under 32 768 elements: a handful of block buffers is well under a MiB; the whole-tensor
    # expression holds several float copies of every input at once (over 10 MiB here).
    assert _peak_bytes(lambda: METHODS[method](ctx)) <= result_bytes + 2**20

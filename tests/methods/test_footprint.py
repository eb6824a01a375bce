"""Each merge method's measured working memory against what the memory governor reserves for it.

The figures each method declares (``MethodSpec.footprint``, evaluated by :mod:`resumerge.merge.methods.footprint`) must
cover every registered method, in every compute dtype, with and without a base, on a 2-D and a 1-D tensor — and must
not be generous beyond 1.6× the measurement, or ``plan`` over-states RAM and refuses merges that fit. Measured by
``footprint_cases`` (torch's profiler, replayed), whose own replay is checked first against allocations computed by
hand. Small tensors stand for large ones because the per-element working set is the same
(``bench/method_footprint.py`` shows it on a 2048×2048 tensor): what does not scale — the bounded scratch of SCE,
DELLA, RAM and half-precision dot products — is modelled by block and exercised here (slerp's 2²⁰-element chunks
only by the bench, on tensors past them). The estimates themselves are pinned: ``footprint_pinned.json`` holds what
every method's footprint gave over a grid of dtypes, shapes, input counts and base/no base when the figures moved
from a table in merge/methods/footprint.py into each method's registration; a changed figure must change that file too
(re-measure with ``bench/method_footprint.py --fit`` first).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from methods.footprint_cases import DTYPES, Case, cases, measure, peaks, variants
from resumerge.merge.methods import MergeContext, MethodSpec, declared, get_method, method_names
from resumerge.merge.methods.footprint import (
    CALL_BYTES,
    MARGIN,
    MEASURED_DTYPES,
    MethodFootprint,
    dot_scratch,
    working_bytes,
)

SHAPES = ((64, 256), (16384,))
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}
GENEROUS = 1.6

Job = tuple[Case, tuple[int, ...], torch.dtype]


def _merge_methods() -> list[str]:
    """The merge methods of :mod:`resumerge.merge.methods` (other packages' unit functions, LoRA extraction's factors,
    are measured by their own tests; so are ``regmean`` and ``regmean_plus``, whose working set follows the n × n
    Grams the planner adds to their inputs, which these calls do not have: tests/methods/test_regmean.py)."""
    return [name for name in method_names() if name not in ("regmean", "regmean_plus")]


def _jobs() -> tuple[list[Job], list[Job]]:
    """(representative calls on every shape, other code paths on the first shape), every method and dtype."""
    typical = [(c, s, d) for m in _merge_methods() for d in DTYPES for s in SHAPES for c in cases(m)]
    other = [(c, SHAPES[0], d) for m in _merge_methods() for d in DTYPES for c in variants(m)]
    return typical, other


@pytest.fixture(scope="module")
def peaks_by_group() -> dict[str, Any]:
    typical, other = _jobs()
    got = measure(typical + other)
    return {"typical": list(zip(typical, got[: len(typical)])), "other": list(zip(other, got[len(typical) :]))}


def _footprint(method: str) -> MethodFootprint:
    spec = get_method(method)
    assert spec is not None and spec.footprint is not None, method
    return spec.footprint


def _reserved(job: Job) -> int:
    case, shape, dtype = job
    return working_bytes(_footprint(case.method), NAMES[dtype], shape, case.inputs, base=case.base is not None)


def test_the_replay_gives_hand_computed_peaks() -> None:
    from resumerge.merge.methods import ranking

    def three_buffers() -> torch.Tensor:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 live
        b = torch.empty(2000, dtype=torch.float32)  # 12000 live: the peak
        del a
        return b  # 8000 stay live as the result

    values = torch.arange(10_000, dtype=torch.int32)
    # order_statistics selects in numpy: a copy of the 40000-byte keys the profiler cannot see. tracemalloc also
    # counts the Python objects a call makes (about 100 bytes a tensor), never more than a few kB here.
    got = peaks([three_buffers, lambda: torch.empty(3, dtype=torch.float64),
                 lambda: ranking.order_statistics(values, [5])])
    assert [g - e for g, e in zip(got, [12000, 24, 40_000], strict=True)] < [4096] * 3, got
    assert all(g >= e for g, e in zip(got, [12000, 24, 40_000], strict=True)), got


def test_linear_peaks_at_its_accumulator(peaks_by_group: dict[str, Any]) -> None:
    # linear accumulates in float32 (float64 for float64) and returns the accumulator cast back, which for float32
    # is the accumulator itself; a half-precision input is widened to float32 inside addcmul_, one at a time.
    per_element = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 8, torch.float16: 8}
    for (case, shape, dtype), peak in peaks_by_group["typical"]:
        if case.method == "linear":
            expected = per_element[dtype] * math.prod(shape)
            assert expected <= peak <= expected + CALL_BYTES, (case.label, dtype, peak)


@pytest.mark.parametrize("group", ["typical", "other"])
def test_no_method_outgrows_its_footprint(peaks_by_group: dict[str, Any], group: str) -> None:
    over = [f"{c.label} {NAMES[d]} {s}: measured {p}, reserved {_reserved((c, s, d))}"
            for (c, s, d), p in peaks_by_group[group] if p > _reserved((c, s, d))]
    assert not over, "\n".join(over)


def _dot_scratch_here(dtype: torch.dtype, elements: int) -> int:
    """What this machine's torch allocates for one half-precision ``dot`` of ``elements``.

    The footprint reserves what torch's CPU kernel allocates on the CPUs it was measured on
    (bench/method_footprint.py), an upper bound wherever the merge runs; other CPUs take other kernels (an AMD EPYC
    with torch 2.13 allocates nothing, an Intel Xeon about 64 KiB a thread). Only the "not far above" check puts
    this machine's figure in the reservation's place, since this machine's measurement cannot see the rest."""
    a, b = torch.ones(elements, dtype=dtype), torch.ones(elements, dtype=dtype)
    (peak,) = peaks([lambda: torch.dot(a, b)])
    return int(peak)


def test_no_footprint_is_far_above_its_measurement(peaks_by_group: dict[str, Any]) -> None:
    # The estimate does not read parameters, so it must cover the most demanding variant of a call (breadcrumbs'
    # rescale in float64 takes a fifth more): each representative call is compared with the largest of it and
    # its variants with the same inputs. A variant that skips work (no sparsification) may use much less.
    # Variants run on the first shape only; their excess per element is carried over to the second.
    excess: dict[tuple[str, int, bool, torch.dtype], float] = {}
    typical = {(c.method, c.inputs, c.base is None, s, d): p for (c, s, d), p in peaks_by_group["typical"]}
    for (c, s, d), p in peaks_by_group["other"]:
        key = (c.method, c.inputs, c.base is None, d)
        excess[key] = max(excess.get(key, 0.0), (p - typical[(*key[:3], s, d)]) / math.prod(s))
    generous = []
    for (c, s, d), p in peaks_by_group["typical"]:
        most = p + max(0.0, excess.get((c.method, c.inputs, c.base is None, d), 0.0)) * math.prod(s)
        reserved = _reserved((c, s, d))
        unseen = dot_scratch(_footprint(c.method), NAMES[d], math.prod(s), torch.get_num_threads())
        here = _dot_scratch_here(d, math.prod(s)) if unseen else 0
        if here < unseen:
            reserved -= math.ceil(unseen * MARGIN) - math.ceil(here * MARGIN)
        if reserved > GENEROUS * most:
            generous.append(f"{c.label} {NAMES[d]} {s}: measured {most}, reserved {reserved}")
    assert not generous, "\n".join(generous)


def test_every_registered_method_and_dtype_is_measured() -> None:
    assert tuple(NAMES.values()) == MEASURED_DTYPES
    missing = [(m, d) for m in _merge_methods() for d in MEASURED_DTYPES if d not in _footprint(m).by_dtype]
    assert not missing, missing
    assert all(cases(m) for m in _merge_methods())
    assert MARGIN < GENEROUS


def test_every_footprint_gives_its_pinned_estimates() -> None:
    pinned = json.loads((Path(__file__).parent / "footprint_pinned.json").read_text())
    grid = pinned["grid"]
    assert sorted(pinned["bytes"]) == _merge_methods()
    changed = []
    for method in _merge_methods():
        got = [working_bytes(_footprint(method), dtype, shape, inputs, base=base, threads=grid["threads"])
               for dtype in grid["dtypes"] for shape in grid["shapes"] for inputs in grid["inputs"]
               for base in grid["base"]]
        if got != pinned["bytes"][method]:
            changed.append(method)
    assert not changed, changed
    assert {"int64", *MEASURED_DTYPES} <= set(grid["dtypes"])  # an unmeasured dtype's rule is pinned too


def test_a_method_without_a_footprint_is_refused_in_a_declaration() -> None:
    def identity(ctx: MergeContext) -> torch.Tensor:
        return ctx.tensors[0].clone()

    with pytest.raises(ValueError, match="declares no footprint"):
        declared(MethodSpec(name="footprintless_test_method", fn=identity))
    with pytest.raises(ValueError, match="declared twice"):
        declared(*(MethodSpec(name="twice", fn=identity, footprint=get_method("linear").footprint),) * 2)

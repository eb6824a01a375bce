"""``core_space``: parity with the authors' code and the identities of ``methods-2025.md`` §4.

Parity: ``data/core_space_reference.safetensors`` holds the authors' merged delta U_ref·M·Vᴴ_ref for seeded random
float64 factors, computed once by running ``MatrixPerLayerMerger.get_core_matrices`` and ``_merge_tensors`` of
apanariello4/core-space-merging 85176fa (``tv``; ``ties`` with topK 30; ``tsv``) from a throwaway script; the file's
metadata names the source, the seeds and the factors' sha256. Their code forms each core matrix through per-factor
SVDs and so rounds differently: the comparison has a tolerance, 1e-10 on values of order 1-10.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from resumerge.merge.methods import MergeContext, get_method
from resumerge.merge.methods.core_space import FACTOR, SCALE, TRANSPOSED, core_factors

DATA = Path(__file__).parent / "data"
F64 = torch.float64
INNER = {"task_arithmetic": {}, "ties": {"density": 0.3}, "tsv": {}}


def _factors(case: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(int(case["seed"]))
    a = [torch.randn((r, case["n"]), generator=g, dtype=F64) for r in case["ranks"]]
    b = [torch.randn((case["m"], r), generator=g, dtype=F64) for r in case["ranks"]]
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (*a, *b))).hexdigest()
    assert digest == case["inputs_sha256"], "torch's generator no longer gives the reference's factors"
    return a, b


def _run(base: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], scales: Sequence[float],
         params: dict[str, Any], *, transposed: bool = False) -> torch.Tensor:
    """The registered method over the inputs the planner gives it: the base, then A₁, B₁, A₂, B₂, …"""
    spec = get_method("core_space")
    assert spec is not None
    tensors = [base]
    model_params: list[dict[str, Any]] = [{}]
    for ai, bi, s in zip(a, b, scales, strict=True):
        tensors += [ai, bi]
        model_params += [{FACTOR: f, SCALE: s, TRANSPOSED: transposed} for f in ("A", "B")]
    model_params, bound = spec.bind(model_params, params, 0)
    assert spec.check is not None and spec.check(bound, model_params) is None
    return spec.fn(MergeContext(tensors=tensors, base_index=0, model_params=model_params, params=bound))


@pytest.mark.parametrize("inner", list(INNER))
def test_matches_the_authors_code(inner: str) -> None:
    with safe_open(DATA / "core_space_reference.safetensors", "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        expected = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    compared = 0
    for name, case in cases.items():
        want = expected.get(f"{inner}.{name}.delta")
        if want is None:
            continue
        a, b = _factors(case)
        base = torch.randn((case["m"], case["n"]), generator=torch.Generator().manual_seed(9), dtype=F64)
        out = _run(base, a, b, [1.0] * len(a), {"inner": inner, "scaling": 0.3, **INNER[inner]})
        assert out.dtype == F64
        assert_close(out, base + 0.3 * want, rtol=0, atol=1e-10)
        compared += 1
    assert compared == (2 if inner == "tsv" else 3)


@pytest.mark.parametrize("shape", [(12, 10), (6, 20), (20, 6)])
def test_task_arithmetic_is_the_sum_of_the_scaled_products(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(3)
    ranks, scales = (2, 4, 3), (2.0, 0.5, 1 / 3**0.5)
    a = [torch.randn((r, shape[1]), generator=g, dtype=F64) for r in ranks]
    b = [torch.randn((shape[0], r), generator=g, dtype=F64) for r in ranks]
    want = torch.stack([s * (bi @ ai) for ai, bi, s in zip(a, b, scales, strict=True)]).sum(dim=0)
    base = torch.randn(shape, generator=g, dtype=F64)
    assert_close(_run(base, a, b, scales, {}), base + want, rtol=0, atol=1e-12)
    # fan_in_fan_out layers (GPT-2 Conv1D, embeddings) store the weight transposed: ΔW = (B·A)ᵀ.
    out = _run(base.T.contiguous(), a, b, scales, {"scaling": 0.5}, transposed=True)
    assert_close(out, base.T + 0.5 * want.T, rtol=0, atol=1e-12)


def test_the_merged_factors_have_rank_at_most_the_summed_ranks() -> None:
    g = torch.Generator().manual_seed(4)
    a = [torch.randn((3, 40), generator=g, dtype=F64) for _ in range(2)]
    b = [torch.randn((30, 3), generator=g, dtype=F64) for _ in range(2)]
    for inner in INNER:
        left, right = core_factors(a, b, [1.0, 1.0], inner, 0.5)
        assert left.shape == (30, 6) and right.shape == (6, 40)


def test_ties_does_not_depend_on_the_signs_of_the_basis() -> None:
    # Negating one adapter's A and B leaves its product and the stacks' Gram matrices, hence the bases, unchanged
    # but for the signs LAPACK picks for their singular vectors; a flipped basis vector flips a row or column of
    # every core matrix alike, TIES's elections flip with it, and U_ref·M·Vᴴ_ref is the same.
    g = torch.Generator().manual_seed(5)
    a = [torch.randn((2, 9), generator=g, dtype=F64) for _ in range(3)]
    b = [torch.randn((11, 2), generator=g, dtype=F64) for _ in range(3)]
    base = torch.zeros((11, 9), dtype=F64)
    once = _run(base, a, b, [1.0] * 3, {"inner": "ties", "density": 0.4})
    flipped = _run(base, [-a[0], *a[1:]], [-b[0], *b[1:]], [1.0] * 3, {"inner": "ties", "density": 0.4})
    assert_close(once, flipped, rtol=0, atol=1e-12)


def test_the_base_alone_stays_the_base() -> None:
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(_run(base, [], [], [], {}), base.to(F64))


def test_an_unknown_inner_method_is_a_contract_error() -> None:
    spec = get_method("core_space")
    assert spec is not None and spec.check is not None
    message = spec.check({"inner": "dare"}, [])
    assert message is not None and "task_arithmetic, ties, tsv" in message

"""The SVD merge methods ``tsv``, ``iso_c`` and ``iso_cts``: parity with the authors' code and the identities of
``methods-2025.md`` (§1-3).

Parity: ``data/<method>_reference.safetensors`` hold the authors' merged task vector Δ_M for seeded random float64
inputs, computed once by running their function (TSV-M: ``compute_and_sum_svd_mem_reduction`` of
AntoAndGar/task_singular_vectors a6c9718; Iso: ``iso_c``/``iso_cts`` of danielm1405/iso-merging d34010a) on
the task vectors below; the file's metadata names the source, the seeds and the inputs' sha256 (so a change in
torch's generator fails here instead of comparing other inputs). Their code rounds in other orders ((ΣΔ/T)·T, the
m × m projector, multi_dot), so the comparison has a tolerance, 1e-10 on values of order 1.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from resumerge.merge.methods import get_method
from resumerge.merge.methods.iso import split

Merge = Callable[..., torch.Tensor]
DATA = Path(__file__).parent / "data"
F64 = torch.float64


def _inputs(case: dict[str, Any]) -> list[torch.Tensor]:
    """The case's base and models, regenerated from its seed (as the reference file's metadata describes)."""
    shape: tuple[int, ...] = tuple(case["shape"])
    g = torch.Generator().manual_seed(int(case["seed"]))
    base = torch.randn(shape, generator=g, dtype=F64)
    models = [base + 0.1 * torch.randn(shape, generator=g, dtype=F64) for _ in range(int(case["tasks"]))]
    found = [base, *models]
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in found)).hexdigest()
    assert digest == case["inputs_sha256"], "torch's generator no longer gives the reference's inputs"
    return found


def _reference(method: str) -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor]]:
    with safe_open(DATA / f"{method}_reference.safetensors", "pt") as f:
        meta = f.metadata()
        expected = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    return json.loads(meta["cases"]), expected


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_matches_the_authors_code(merge: Merge, method: str) -> None:
    cases, expected = _reference(method)
    fractions = {"": 0.8, "half_": 0.5} if method == "iso_cts" else {"": None}
    compared = 0
    for prefix, fraction in fractions.items():
        for key, case in cases.items():
            want = expected.get(f"{prefix}{key}.delta")
            if want is None:
                continue
            tensors = _inputs(case)
            params = {"scaling": 0.7} | ({"common_space_fraction": fraction} if fraction is not None else {})
            out = merge(method, tensors, base=0, params=params)
            assert out.dtype == F64
            assert_close(out, tensors[0] + 0.7 * want, rtol=0, atol=1e-10)
            compared += 1
    assert compared == (7 if method == "iso_cts" else 5)


def _tasks(shape: tuple[int, int], count: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=F64)
    return [base, *(base + torch.randn(shape, generator=g, dtype=F64) * 0.1 for _ in range(count))]


def _svdvals(x: torch.Tensor) -> torch.Tensor:
    found: torch.Tensor = torch.linalg.svdvals(x)
    return found


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_tsv_of_one_task_is_its_task_vector(merge: Merge, shape: tuple[int, int]) -> None:
    tensors = _tasks(shape, 1)
    # r = k: the whole delta, so TSV-M of one model is task arithmetic with weight α.
    assert_close(merge("tsv", tensors, base=0), tensors[1], rtol=0, atol=1e-12)
    assert_close(merge("tsv", tensors, base=0, params={"scaling": 0.5}),
                 merge("task_arithmetic", tensors, base=0, per_model={"weight": [None, 0.5]}), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("shape", "count"), [((12, 8), 2), ((8, 12), 3), ((20, 16), 4)])
def test_tsv_keeps_exactly_the_leading_singular_values(merge: Merge, shape: tuple[int, int], count: int) -> None:
    tensors = _tasks(shape, count, seed=count)
    kept = min(shape) // count
    want = torch.cat([_svdvals(t - tensors[0])[:kept] for t in tensors[1:]])
    got = _svdvals(merge("tsv", tensors, base=0) - tensors[0])
    assert_close(got[: len(want)], want.sort(descending=True).values, rtol=0, atol=1e-12)
    assert bool((got[len(want):] < 1e-12).all())  # rank T·r


def test_tsv_is_invariant_to_task_order_and_signs(merge: Merge) -> None:
    tensors = _tasks((10, 14), 3, seed=3)
    out = merge("tsv", tensors, base=0)
    assert_close(merge("tsv", [tensors[0], tensors[3], tensors[1], tensors[2]], base=0), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_the_signs_lapack_picks_do_not_matter(merge: Merge, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each singular triplet's sign is free; another LAPACK (or a GPU) may return any of them.
    tensors = _tasks((14, 10), 3, seed=13)
    want = merge(method, tensors, base=0)
    svd = torch.linalg.svd
    calls = []

    def flipped(x: torch.Tensor, full_matrices: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append(x.shape)
        u, s, vh = svd(x, full_matrices=full_matrices)
        signs = torch.tensor([(-1.0) ** i for i in range(s.shape[0])], dtype=u.dtype)
        return u * signs, s, vh * signs[:, None]

    monkeypatch.setattr(torch.linalg, "svd", flipped)
    got = merge(method, tensors, base=0)
    assert_close(got, want, rtol=0, atol=1e-12)
    assert calls  # the methods' SVDs were the flipped ones


def test_iso_c_is_the_flat_spectrum_of_the_sum(merge: Merge) -> None:
    tensors = _tasks((12, 8), 3, seed=4)
    total = torch.stack([t - tensors[0] for t in tensors[1:]]).sum(0)
    s = _svdvals(total)
    out = merge("iso_c", tensors, base=0, params={"scaling": 2.0}) - tensors[0]
    assert_close(_svdvals(out), torch.full((8,), 2.0 * float(s.mean()), dtype=F64), rtol=0, atol=1e-12)
    u, _, vh = torch.linalg.svd(total, full_matrices=False)
    assert_close(out, 2.0 * float(s.mean()) * (u @ vh), rtol=0, atol=1e-12)


def test_iso_cts_of_the_whole_common_space_is_iso_c(merge: Merge) -> None:
    tensors = _tasks((16, 10), 3, seed=5)
    cts = merge("iso_cts", tensors, base=0, params={"common_space_fraction": 1.0, "scaling": 0.3})
    assert_close(cts, merge("iso_c", tensors, base=0, params={"scaling": 0.3}), rtol=0, atol=1e-12)


def test_iso_cts_spectrum_is_flat_and_full(merge: Merge) -> None:
    tensors = _tasks((20, 16), 3, seed=6)
    s = _svdvals(merge("iso_cts", tensors, base=0) - tensors[0])
    assert_close(s, s[:1].expand(16), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("k", "tasks", "fraction", "want"), [
    (4096, 8, 0.8, (3280, 102)),  # 820/8 = 102.5 rounds half to even, to 102
    (8, 2, 0.8, (6, 1)), (8, 3, 0.8, (5, 1)), (16, 3, 0.5, (7, 3)), (16, 3, 1.0, (16, 0)),
    (3, 2, 0.1, (1, 1)),  # the authors' rounding would ask for 4 of 3 task-specific directions: rounded down
])
def test_iso_cts_splits_the_spectrum_as_the_authors_code(k: int, tasks: int, fraction: float,
                                                          want: tuple[int, int]) -> None:
    common, per_task = split(k, tasks, fraction)
    assert (common, per_task) == want
    assert common + tasks * per_task == k and common >= 0


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_vectors_and_norms_take_the_mean_path(merge: Merge, method: str) -> None:
    base = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32)
    a, b = base + torch.tensor([0.5, 0.0, -1.0]), base + torch.tensor([0.25, 1.0, 0.0])
    out = merge(method, [base, a, b], base=0, params={"scaling": 2.0})
    assert out.dtype == F64
    assert_close(out, (base + (a - base) + (b - base)).to(F64), rtol=0, atol=1e-7)


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_a_matrix_without_svd_takes_the_mean_path(merge: Merge, method: str) -> None:
    # What the planner gives the token embedding and the head by default (MethodSpec.vocab_defaults).
    tensors = _tasks((12, 8), 3, seed=12)
    mean = torch.stack([t - tensors[0] for t in tensors[1:]]).mean(0)
    out = merge(method, tensors, base=0, params={"svd": False, "scaling": 0.5})
    assert_close(out, tensors[0] + 0.5 * mean, rtol=0, atol=1e-14)
    assert get_method(method).vocab_defaults == (("svd", False),)  # type: ignore[union-attr]


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_a_matrix_no_model_changed_stays_the_base(merge: Merge, method: str) -> None:
    # Every singular value is zero: LAPACK's vectors are arbitrary, and none may enter the result.
    base = torch.randn(9, 6, generator=torch.Generator().manual_seed(7), dtype=F64)
    assert torch.equal(merge(method, [base, base.clone(), base.clone()], base=0), base)


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_one_unchanged_model_among_changed_ones_is_well_defined(merge: Merge, method: str) -> None:
    # A zero task vector has no singular directions: its arbitrary LAPACK vectors must not rotate the others'.
    # Whatever LAPACK returns for them, the result is the same as with that model's vectors replaced by others.
    tensors = _tasks((12, 8), 2, seed=8)
    tensors.append(tensors[0].clone())
    out = merge(method, tensors, base=0)
    flipped = [t.flip(0) for t in tensors]  # LAPACK sees other matrices, so other arbitrary vectors
    assert_close(merge(method, flipped, base=0), out.flip(0), rtol=0, atol=1e-12)
    if method == "tsv":  # r = 8 // 3 = 2 of each changed model: rank 4
        assert int((_svdvals(out - tensors[0]) > 1e-10).sum()) == 4


def test_duplicate_tasks_give_the_task_s_kept_components(merge: Merge) -> None:
    # The authors' TSV-M is undefined here (U of rank r, not 2r); the partial isometry gives the one task's rank-r
    # truncation, as two equal models should.
    base, model = _tasks((12, 8), 1, seed=9)
    u, s, vh = torch.linalg.svd(model - base, full_matrices=False)
    assert_close(merge("tsv", [base, model, model.clone()], base=0), base + (u[:, :4] * s[:4]) @ vh[:4], rtol=0,
                 atol=1e-12)


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_half_precision_inputs_are_decomposed_in_float64(merge: Merge, method: str) -> None:
    tensors = _tasks((12, 8), 2, seed=10)
    half = [t.to(torch.bfloat16) for t in tensors]
    out = merge(method, half, base=0)
    assert out.dtype == F64
    assert_close(out, merge(method, [t.to(F64) for t in half], base=0), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_never_writes_its_inputs(merge: Merge, method: str) -> None:
    tensors = _tasks((12, 8), 2, seed=11)
    copies = [t.clone() for t in tensors]
    merge(method, tensors, base=0, params={"scaling": 0.5})
    assert all(torch.equal(t, c) for t, c in zip(tensors, copies, strict=True))


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_contract(method: str) -> None:
    spec = get_method(method)
    assert spec is not None and spec.thread_dependent and spec.whole_cost is not None and not spec.elementwise
    assert spec.param("scaling") is not None and spec.reference.startswith("https://arxiv.org/abs/")

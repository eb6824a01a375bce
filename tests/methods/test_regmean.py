"""``regmean``: the closed form of ``methods-2025.md`` §7 against hand-computed float64, and its identities.

Random symmetric positive-definite Grams Gᵢ = XᵢᵀXᵢ/Nᵢ in float64, as the reference doc prescribes: all Gᵢ equal
give the mean; one model gives itself; a = 0 gives the column formula W[:, j] = Σ Gᵢ[j,j]·Wᵢ[:, j] / Σ Gᵢ[j,j]; and
the normal equations Σ (W − Wᵢ)·G̃ᵢ = 0 hold. The expected values are computed here by ``torch.linalg.inv`` on the
same inputs (the authors' ``regmean_mean_params`` is exactly that inverse product, in float32), never by the
method's own Cholesky path. Parity with the authors' code: ``data/regmean_reference.safetensors`` holds what their
``regmean_mean_params`` returned for seeded inputs (the file names the commit, the seeds and the inputs' sha256).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from resumerge.merge.methods import MergeContext, get_method
from resumerge.merge.methods.regmean import GRAM, RATIO, regmean_solve, regularised

F64 = torch.float64
DATA = Path(__file__).parent / "data"


def _case(models: int, m: int = 6, n: int = 5, tokens: int = 40, seed: int = 0, g: torch.Generator | None = None
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weights, draws = _draws(models, m, n, tokens, g if g is not None else torch.Generator().manual_seed(seed))
    grams = []
    for noise, scale in draws:
        x = noise * scale.add(0.5)
        grams.append(x.T @ x / tokens)
    return weights, grams


def _draws(models: int, m: int, n: int, tokens: int, g: torch.Generator
           ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The seeded draws a case is made of: each model's weight, then each model's token inputs and their scale."""
    weights = [torch.randn(m, n, generator=g, dtype=F64) for _ in range(models)]
    return weights, [(torch.randn(tokens, n, generator=g, dtype=F64), torch.rand(n, generator=g, dtype=F64))
                     for _ in range(models)]


def _by_hand(weights: list[torch.Tensor], grams: list[torch.Tensor], a: float) -> torch.Tensor:
    tilde = [a * g + (1 - a) * torch.diag(torch.diagonal(g)) for g in grams]
    return sum(w @ t for w, t in zip(weights, tilde)) @ torch.linalg.inv(sum(tilde))  # type: ignore[return-value]


def _method(weights: list[torch.Tensor], grams: list[torch.Tensor], a: float) -> torch.Tensor:
    spec = get_method("regmean")
    assert spec is not None
    params = [{} for _ in weights] + [{GRAM: True} for _ in grams]
    bound_models, bound = spec.bind(params, {"grams": "x", RATIO: a}, None)
    return spec.fn(MergeContext([*weights, *grams], None, bound_models, bound))


@pytest.mark.parametrize("a", [1.0, 0.5, 0.1, 0.0])
def test_matches_the_closed_form(a: float) -> None:
    weights, grams = _case(3)
    assert_close(_method(weights, grams, a), _by_hand(weights, grams, a), rtol=1e-10, atol=1e-12)


def test_equal_grams_give_the_mean() -> None:
    weights, grams = _case(4)
    same = [grams[0]] * 4
    assert_close(_method(weights, same, 0.7), sum(weights) / 4, rtol=1e-10, atol=1e-12)  # type: ignore[arg-type]


def test_one_model_gives_itself() -> None:
    weights, grams = _case(1)
    assert_close(_method(weights, grams, 0.5), weights[0], rtol=1e-10, atol=1e-12)


def test_no_off_diagonals_give_the_column_formula() -> None:
    weights, grams = _case(3)
    d = [torch.diagonal(g) for g in grams]
    expected = sum(w * dg for w, dg in zip(weights, d)) / sum(d)  # type: ignore[operator]
    assert_close(_method(weights, grams, 0.0), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("a", [1.0, 0.3])
def test_normal_equations_hold(a: float) -> None:
    weights, grams = _case(3, m=7, n=9, tokens=50, seed=3)
    merged = _method(weights, grams, a)
    residual = sum((merged - w) @ regularised(g, a) for w, g in zip(weights, grams))
    assert float(residual.abs().max()) < 1e-10  # type: ignore[union-attr]


def test_a_coordinate_no_token_reached_takes_the_mean() -> None:
    """Column 2 of every Gram is zero (the input was always 0 there): that column is the mean, the rest is the
    solve without it."""
    weights, grams = _case(3)
    for g in grams:
        g[2, :] = 0
        g[:, 2] = 0
    merged, used_pinv = regmean_solve(weights, grams, 0.5)
    assert not used_pinv
    assert_close(merged[:, 2], sum(w[:, 2] for w in weights) / 3)  # type: ignore[arg-type]
    keep = [0, 1, 3, 4]
    expected = _by_hand([w[:, keep] for w in weights], [g[keep][:, keep] for g in grams], 0.5)
    assert_close(merged[:, keep], expected, rtol=1e-10, atol=1e-12)


def test_singular_grams_fall_back_to_the_pseudo_inverse() -> None:
    """Fewer tokens than inputs and a = 1: Σ Gᵢ is singular; the pseudo-inverse gives the minimum-norm solution,
    which still satisfies the normal equations."""
    weights, grams = _case(2, n=8, tokens=3)
    merged, used_pinv = regmean_solve(weights, grams, 1.0)
    assert used_pinv
    assert_close(merged, sum(w @ g for w, g in zip(weights, grams)) @ torch.linalg.pinv(sum(grams)),  # type: ignore
                 rtol=1e-8, atol=1e-10)
    residual = sum((merged - w) @ g for w, g in zip(weights, grams))
    assert float(residual.abs().max()) < 1e-8  # type: ignore[union-attr]


def test_tensors_without_grams_are_averaged() -> None:
    weights, _ = _case(3)
    bias = [w[0] for w in weights]
    spec = get_method("regmean")
    assert spec is not None
    bound_models, bound = spec.bind([{}, {}, {}], {"grams": "x"}, None)
    assert_close(spec.fn(MergeContext(bias, None, bound_models, bound)), sum(bias) / 3)  # type: ignore[arg-type]


def test_float32_grams_and_half_weights_are_solved_in_float64() -> None:
    weights, grams = _case(2)
    merged = _method([w.to(torch.bfloat16) for w in weights], [g.float() for g in grams], 0.5)
    assert merged.dtype == F64
    expected = _by_hand([w.to(torch.bfloat16).to(F64) for w in weights], [g.float().to(F64) for g in grams], 0.5)
    assert_close(merged, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("shape", "models", "a"), [((64, 256), 2, 0.5), ((256, 64), 3, 0.5), ((96, 128), 2, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_solve_stays_within_its_declared_footprint(shape: tuple[int, int], models: int, a: float,
                                                       dtype: torch.dtype) -> None:
    """The profiler replay of tests/methods/footprint_cases.py on the Gram path (a = 1 with fewer tokens than
    inputs: the pseudo-inverse), against what the planner reserves for a tensor with its weights and Grams."""
    from methods.footprint_cases import peaks
    from resumerge.merge.methods.footprint import working_bytes
    from resumerge.merge.methods.regmean import FOOTPRINT

    m, n = shape
    weights, grams = _case(models, m=m, n=n, tokens=n // 2 if a == 1.0 else 2 * n)
    tensors = [w.to(dtype) for w in weights] + [g.float() for g in grams]
    seen = "float64" if dtype == torch.float64 else "float32"
    if seen == "float32":  # as the engine promotes inputs stored in different dtypes
        tensors = [t.float() for t in tensors]
    (peak,) = peaks([lambda: _method(tensors[:models], tensors[models:], a)])
    reserved = working_bytes(FOOTPRINT, seen, shape, 2 * models, base=False)
    assert peak <= reserved, (peak, reserved)
    # The mean path of a vector (a norm): its float64 sum and one float64 copy.
    vectors = [w[0].to(dtype) for w in weights]
    (peak,) = peaks([lambda: _method(vectors, [], a)])
    assert peak <= working_bytes(FOOTPRINT, seen, (n,), models, base=False), peak


def _reference_case(case: dict[str, object]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The inputs the reference file was made from, regenerated from its seed (the file names their sha256)."""
    # type: ignore[call-overload]
    models, m, n, tokens, seed = (int(case[k]) for k in ("models", "m", "n", "tokens", "seed"))
    g = torch.Generator().manual_seed(seed)
    weights, draws = _draws(models, m, n, tokens, g)
    bias = [torch.randn(m, generator=g, dtype=F64) for _ in range(models)]
    # The digest covers the draws, not the Grams made of them: x.T @ x is a BLAS product whose last bits depend on
    # the CPU's kernels (an AVX-512 machine's differ from the one the reference was made on), which the
    # comparison's tolerance absorbs; the draws are torch's seeded generator's, the same on every CPU.
    drawn = [*weights, *(t for pair in draws for t in pair), *bias]
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in drawn)).hexdigest()
    assert digest == case["inputs_sha256"], "torch's generator no longer gives the reference's inputs"
    weights, grams = _case(models, m, n, tokens, g=torch.Generator().manual_seed(seed))
    return weights, grams, bias


def test_matches_the_authors_code() -> None:
    """``data/regmean_reference.safetensors``: the authors' ``regmean_mean_params`` (bloomberg/dataless-model-
    merging 92247ae, run once on these seeded float64 inputs: a linear's weight with each model's Gram, and its
    bias, for five ratios of the off-diagonals, -1 being the authors' "no reduction")."""
    with safe_open(DATA / "regmean_reference.safetensors", "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        expected = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
    assert len(cases) == 5
    for i, case in enumerate(cases):
        weights, grams, bias = _reference_case(case)
        # The authors scale the off-diagonals by a float32 tensor filled with the ratio: 0.1 is 0.100000001 there.
        ratio = float(torch.tensor(float(case["reduce_non_diagonal_ratio"]), dtype=torch.float32))
        got = _method(weights, grams, 1.0 if ratio < 0 else ratio)
        assert_close(got, expected[f"case{i}.weight"], rtol=1e-10, atol=1e-12)
        spec = get_method("regmean")
        assert spec is not None
        bound_models, bound = spec.bind([{} for _ in bias], {"grams": "x"}, None)
        assert_close(spec.fn(MergeContext(bias, None, bound_models, bound)), expected[f"case{i}.bias"],
                     rtol=1e-12, atol=1e-14)

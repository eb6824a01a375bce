"""Differential tests against mergekit 0.1.5's own method implementations (skipped without mergekit).

mergekit is called through its in-memory API, ``mergekit.merge_methods.merge_tensors``, which runs the same
method objects as its graph executor. Deterministic methods must agree within 1e-6 (relative to the tensor's
largest value) in float32 and within one ulp in float16/bfloat16; in practice they are bit-identical. The
randomized methods draw from mergekit's global RNG, so they are compared statistically (keep rate, L1
rescale) with unrelated seeds, and exactly when both RNGs are seeded alike (the masks then coincide on CPU).

The one deliberate difference: where equal magnitudes (variances for SCE) compete for the last places of a
ranking, resumerge keeps them in index order and mergekit in its unstable sort's order. Rank-based methods must
therefore agree everywhere except at such threshold ties (counted, see ``tieparity.py``), and bit for bit with
mergekit once its sorts are made stable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from methods.tieparity import RANKED, make_sorts_stable, row_ties, straddling, threshold_ties
from resumerge.merge.methods import BasePolicy, MethodSpec, Scope, get_method, method_names, sparsify

mergekit_methods = pytest.importorskip("mergekit.merge_methods")
mergekit_sparsify = pytest.importorskip("mergekit.sparsify")

pytestmark = pytest.mark.oracle
Merge = Callable[..., torch.Tensor]

# Methods resumerge has and mergekit 0.1.5 has not (issue 59's SVD methods): no oracle to compare with.
BEYOND_MERGEKIT = frozenset({"tsv", "iso_c", "iso_cts", "core_space", "regmean", "regmean_plus"})
SCOPES = {"shared": Scope.GLOBAL, "input": Scope.PER_MODEL, "non_base": Scope.NON_BASE}
W = [None, 0.3, 0.5, 0.2]
D = [None, 0.5, 0.6, 0.3]

# (method, input count, base index, global params, per-model params): one row per configuration compared.
VARIANTS: list[tuple[str, int, int | None, dict[str, Any], dict[str, list[Any]]]] = [
    ("linear", 3, None, {}, {"weight": [0.3, 0.5, 0.2]}),
    ("linear", 3, None, {"normalize": False}, {"weight": [0.3, -0.5, 1.2]}),
    ("passthrough", 1, None, {}, {}),
    ("passthrough", 1, None, {}, {"scale": [0.5]}),
    ("slerp", 2, 0, {"t": 0.3}, {}),
    ("slerp", 2, 1, {"t": 0.85}, {}),
    ("nuslerp", 2, None, {}, {"weight": [0.4, 0.6]}),
    ("nuslerp", 3, 1, {}, {"weight": [0.4, None, 0.6]}),
    ("nuslerp", 3, 0, {"nuslerp_flatten": False}, {"weight": [None, 1.0, 3.0]}),
    ("nuslerp", 3, 0, {"nuslerp_flatten": False, "nuslerp_row_wise": True}, {"weight": [None, 1.0, 3.0]}),
    ("multislerp", 4, 0, {}, {"weight": W}),
    ("multislerp", 3, None, {"normalize_weights": False}, {"weight": [0.3, 0.5, 0.2]}),
    ("karcher", 3, None, {}, {}),
    ("karcher", 4, 0, {"max_iter": 3, "tol": 1e-3}, {}),
    ("task_arithmetic", 4, 0, {"lambda": 0.9}, {"weight": W}),
    ("task_arithmetic", 4, 2, {"normalize": True}, {"weight": [0.3, 0.5, None, 0.2]}),
    ("ties", 4, 0, {}, {"weight": W, "density": D}),
    ("ties", 4, 0, {"rescale": True, "int8_mask": True, "normalize": False}, {"weight": W, "density": D}),
    ("breadcrumbs", 4, 0, {}, {"weight": W, "density": D, "gamma": [None, 0.05, 0.02, 0.1]}),
    ("breadcrumbs_ties", 4, 0, {"rescale": True}, {"weight": W, "density": D, "gamma": [None, 0.05, 0.02, 0.1]}),
    ("sce", 4, 0, {}, {}),
    ("sce", 4, 0, {"select_topk": 0.3, "int8_mask": True}, {}),
    ("ram", 4, 0, {}, {}),
    ("ram", 4, 0, {"epsilon": 0.05}, {}),
    ("ramplus_tl", 4, 0, {}, {}),
    ("ramplus_tl", 4, 0, {"r": 0.5, "alpha": 0.6, "epsilon": 0.05}, {}),
    ("model_stock", 4, 0, {}, {}),
    ("model_stock", 3, 0, {"filter_wise": True}, {}),
    ("nearswap", 2, 0, {"t": 0.05}, {}),
    ("arcee_fusion", 2, 0, {}, {}),
]
RANDOMIZED: list[tuple[str, dict[str, list[Any]]]] = [
    ("dare_ties", {"weight": W, "density": D}),
    ("dare_linear", {"weight": W, "density": D}),
    ("della", {"weight": W, "density": D, "epsilon": [None, 0.1, 0.2, 0.15]}),
    ("della_linear", {"weight": W, "density": D, "epsilon": [None, 0.1, 0.2, 0.15]}),
]
SHAPES = [(17, 23), (23,), (2, 5, 7)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def make_inputs(
    count: int, base: int | None, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    """A base ~ N(0, 1) and fine-tunes differing on a random 70 % of positions (exact zeros elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    center = torch.randn(shape, generator=gen)
    out = []
    for i in range(count):
        noise = 0.1 * torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.7)
        out.append((center if i == base else center + noise).to(dtype))
    return out


def run_mergekit(
    method: str,
    tensors: Sequence[torch.Tensor],
    base: int | None,
    params: Mapping[str, Any],
    per_model: Mapping[str, Sequence[Any]],
    seed: int = 0,
) -> torch.Tensor:
    parameters = dict(params)
    for name, values in per_model.items():
        parameters[name] = {i: v for i, v in enumerate(values) if v is not None}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        result: torch.Tensor = mergekit_methods.merge_tensors(
            list(tensors), method, parameters=parameters, base_index=base
        )
    return result


def assert_parity(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """float32/64: within 1e-6 of the largest magnitude; float16/bfloat16: within one ulp of mergekit's value."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert bool(torch.isfinite(theirs).all()) and bool(torch.isfinite(ours).all())
    if theirs.dtype in (torch.float32, torch.float64):
        scale = float(theirs.abs().max()) if theirs.numel() else 0.0
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * scale)
        return
    up = torch.nextafter(theirs, torch.full_like(theirs, float("inf"))) - theirs
    down = theirs - torch.nextafter(theirs, torch.full_like(theirs, float("-inf")))
    ulp = torch.maximum(up.abs(), down.abs()).double()
    worst = ((ours.double() - theirs.double()).abs() - ulp).max()
    assert float(worst) <= 0, f"more than one ulp apart (excess {float(worst):.3g})"


def spec(name: str) -> MethodSpec:
    found = get_method(name)
    assert found is not None
    return found


def accepts(s: MethodSpec, count: int, has_base: bool) -> bool:
    """Whether resumerge's declared contract accepts ``count`` inputs, one of which may be the base."""
    if s.base is BasePolicy.REQUIRED and not has_base:
        return False
    if s.base is BasePolicy.FORBIDDEN and has_base:
        return False
    if count < s.min_inputs or (s.max_inputs is not None and count > s.max_inputs):
        return False
    others = count - int(has_base and s.base is not BasePolicy.IGNORED)
    if s.min_non_base is not None and others < s.min_non_base:
        return False
    return s.max_non_base is None or others <= s.max_non_base


def _mergekit_names() -> list[str]:
    return [name for name in method_names() if name not in BEYOND_MERGEKIT]


def test_same_method_names() -> None:
    assert _mergekit_names() == sorted(m.spec.name for m in mergekit_methods.registered_methods())


@pytest.mark.parametrize("name", _mergekit_names())
def test_same_parameters_and_input_contract(name: str) -> None:
    ours, theirs = spec(name), mergekit_methods.get(name).spec
    expected = {
        p.name: (SCOPES[p.scope.value], None if p.required else p.default, p.required) for p in theirs.parameters
    }
    assert {p.name: (p.scope, p.default, p.required) for p in ours.params} == expected
    assert ours.base.value == theirs.contract.base.value
    for count in range(1, 6):
        for has_base in (False, True):
            ids = list(range(count))
            try:
                theirs.contract.validate_ids(ids, 0 if has_base else None)
                mergekit_ok = True
            except ValueError:
                mergekit_ok = False
            assert accepts(ours, count, has_base) == mergekit_ok, (count, has_base)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("method", "count", "base", "params", "per_model"), VARIANTS, ids=lambda v: str(v))
def test_deterministic_methods_match(
    merge: Merge,
    method: str,
    count: int,
    base: int | None,
    params: dict[str, Any],
    per_model: dict[str, list[Any]],
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> None:
    tensors = make_inputs(count, base, shape, dtype, seed=len(shape) + count)
    ours = merge(method, tensors, base=base, params=params, per_model=per_model)
    theirs = run_mergekit(method, tensors, base, params, per_model)
    if method in RANKED:
        assert base is not None
        ties = threshold_ties(method, tensors, base, params, per_model)
        # Exact wherever no tie straddles a threshold (the whole tensor when there is none); only the threshold
        # ties themselves may differ.
        assert_parity(ours[~ties], theirs[~ties])
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        return
    assert_parity(ours, theirs)


# SCE ranks only below select_topk 1.
RANKED_VARIANTS = [v for v in VARIANTS if v[0] in RANKED and (v[0] != "sce" or v[3].get("select_topk", 1.0) < 1)]


def coarse(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Round to multiples of 1/4, so that equal magnitudes and variances straddle thresholds in every dtype."""
    return [((t.double() * 4).round() / 4).to(t.dtype) for t in tensors]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("method", "count", "base", "params", "per_model"), RANKED_VARIANTS, ids=lambda v: str(v))
def test_rank_based_methods_match_mergekit_bit_for_bit_once_its_sorts_are_stable(
    merge: Merge,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    count: int,
    base: int | None,
    params: dict[str, Any],
    per_model: dict[str, list[Any]],
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> None:
    tensors = coarse(make_inputs(count, base, shape, dtype, seed=11))
    ours = merge(method, tensors, base=base, params=params, per_model=per_model)
    assert base is not None and bool(threshold_ties(method, tensors, base, params, per_model).any())
    make_sorts_stable(monkeypatch)
    assert torch.equal(ours, run_mergekit(method, tensors, base, params, per_model))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_matches_mergekit_bit_for_bit_once_its_sorts_are_stable(
    merge: Merge, monkeypatch: pytest.MonkeyPatch, method: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    # Ranks run along dim 1 (a 1-D tensor is one row, a 3-D one has rows across its first and last dims).
    tensors = coarse(make_inputs(4, 0, shape, dtype, seed=3))
    per_model = {"weight": W, "density": D, "epsilon": [None, 0.1, 0.2, 0.15]}
    ours = merge(method, tensors, base=0, per_model=per_model, seed=1234)
    make_sorts_stable(monkeypatch)
    assert torch.equal(ours, run_mergekit(method, tensors, 0, {}, per_model, seed=1234))


def _realistic(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A base around ±0.02 and a fine-tune 1 % away from it: in bfloat16 many magnitudes are equal.
    gen = torch.Generator().manual_seed(seed)
    base = 0.02 * torch.randn(96, 320, generator=gen)
    return base.to(dtype), (base + 2e-4 * torch.randn(96, 320, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("sparsifier", ["magnitude", "magnitude_outliers", "della_magprune"])
def test_sparsifiers_differ_from_mergekit_only_at_threshold_ties(sparsifier: str, dtype: torch.dtype) -> None:
    base, tuned = _realistic(dtype, seed=21)
    delta = tuned - base
    magnitudes = delta.abs().float()
    n = delta.numel()
    if sparsifier == "magnitude":
        ours = sparsify.magnitude(delta, 0.3, rescale=False)
        theirs = mergekit_sparsify.magnitude(delta, 0.3)
        ties = straddling(magnitudes, 0, int(0.3 * n), descending=True)
    elif sparsifier == "magnitude_outliers":
        ours = sparsify.magnitude_outliers(delta, 0.3, 0.05, rescale=False)
        theirs = mergekit_sparsify.magnitude_outliers(delta, 0.3, gamma=0.05)
        skip = n - int(0.3 * n) - int(0.05 * n)
        ties = straddling(magnitudes, skip, skip + int(0.3 * n), descending=False)
    else:
        ours = sparsify.sample(delta, sparsify.Sampled(0.4, 0.2), rescale=False,
                               generator=torch.Generator().manual_seed(5))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            theirs = mergekit_sparsify.della_magprune(delta, 0.4, 0.2)
        ties = row_ties(delta.abs())
        # mergekit masks float64 in float32 (the kept values round); what is kept must still agree.
        ours, theirs = ours != 0, theirs != 0
    differ = ours != theirs
    assert bool((ties | ~differ).all()), "a difference away from any tie"
    if not bool(ties.any()):
        assert torch.equal(ours, theirs)
    # Half types have few distinct magnitudes: the tie rule must have been exercised.
    assert dtype in (torch.float32, torch.float64) or bool(ties.any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("method", "per_model"), RANDOMIZED, ids=lambda v: str(v))
def test_randomized_methods_match_when_seeded_alike(
    merge: Merge, monkeypatch: pytest.MonkeyPatch, method: str, per_model: dict[str, list[Any]], dtype: torch.dtype
) -> None:
    tensors = make_inputs(4, 0, (17, 23), dtype, seed=3)
    ours = merge(method, tensors, base=0, per_model=per_model, seed=1234)
    if method.startswith("della"):
        # DELLA ranks each row; equal nonzero magnitudes in a row (common in bfloat16) rank by index here and by
        # mergekit's unstable sort there, so only then is mergekit's sort made stable. Equal zeros change nothing.
        tied = [row_ties(t - tensors[0]) & (t != tensors[0]) for t in tensors[1:]]
        if any(bool(t.any()) for t in tied):
            make_sorts_stable(monkeypatch)
    assert_parity(ours, run_mergekit(method, tensors, 0, {}, per_model, seed=1234))


@pytest.mark.parametrize("method", ["dare_linear", "della_linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_randomized_methods_keep_rate_and_rescale_statistics(merge: Merge, method: str, dtype: torch.dtype) -> None:
    # One fine-tune with a dense, one-signed delta: every kept entry is nonzero and its scale is visible.
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 1024, generator=gen).to(dtype)
    tuned = (base.float() + 0.05 + torch.rand(64, 1024, generator=gen)).to(dtype)
    per_model = {"weight": [None, 1.0], "density": [None, 0.3], "epsilon": [None, 0.2]}
    if method == "dare_linear":
        del per_model["epsilon"]
    delta = (tuned - base).double()
    stats = []
    for result in (
        merge(method, [base, tuned], base=0, per_model=per_model, seed=7),
        run_mergekit(method, [base, tuned], 0, {}, per_model, seed=99),
    ):
        kept = (result - base).double() != 0
        # per-row keep rate by magnitude rank: DELLA keeps large entries more often, DARE does not care
        order = torch.argsort(delta, dim=1)
        top = kept.gather(1, order[:, -256:]).double().mean().item()
        bottom = kept.gather(1, order[:, :256]).double().mean().item()
        l1_ratio = ((result - base).double().abs().sum() / delta.abs().sum()).item()
        stats.append((kept.double().mean().item(), top, bottom, l1_ratio))
    (rate, top, bottom, ratio), (mk_rate, mk_top, mk_bottom, mk_ratio) = stats
    assert abs(rate - mk_rate) < 0.01
    assert abs(top - mk_top) < 0.03 and abs(bottom - mk_bottom) < 0.03
    assert ratio == pytest.approx(mk_ratio, rel=1e-2) and ratio == pytest.approx(1.0, rel=1e-2)


def test_slerp_matches_across_the_chunk_boundary(merge: Merge) -> None:
    # More than 2**20 elements: norms and the dot product are accumulated chunk by chunk in both.
    tensors = make_inputs(2, 0, (1030, 1024), torch.float32, seed=0)
    assert_parity(merge("slerp", tensors, base=0, params={"t": 0.4}), run_mergekit("slerp", tensors, 0, {"t": 0.4}, {}))


def test_arcee_fusion_samples_quantiles_like_mergekit_when_seeded_alike(merge: Merge) -> None:
    tensors = make_inputs(2, 0, (1001, 1000), torch.float32, seed=1)  # above the 1M-element sampling threshold
    ours = merge("arcee_fusion", tensors, base=0, seed=5)
    assert_parity(ours, run_mergekit("arcee_fusion", tensors, 0, {}, {}, seed=5))


def test_della_epsilon_error_fires_for_the_same_values(merge: Merge) -> None:
    tensors = make_inputs(2, 0, (4, 4), torch.float32, seed=0)
    per_model = {"weight": [None, 1.0], "density": [None, 0.9], "epsilon": [None, 0.15]}
    with pytest.raises(ValueError, match=r"density \+/- epsilon"):
        run_mergekit("della", tensors, 0, {}, per_model)
    with pytest.raises(ValueError, match=r"density \+/- epsilon"):
        merge("della", tensors, base=0, per_model=per_model)
    check = spec("della").check
    assert check is not None and check({}, [{}, {"weight": 1.0, "density": 0.9, "epsilon": 0.15}])

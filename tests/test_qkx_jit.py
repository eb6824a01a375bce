"""The compiled ``make_qkx2/3_quants`` search (resumerge/outputs/gguf/qkxloop.py) against its numpy path
(``ksearch.qkx_numpy``), bit for bit in every scale, min and code: over every parameter set the K encoders use, on
random columns and adversarial ones (ties between candidates, flat and all-zero sub-blocks, signed zeros, one-ulp
neighbours, huge, tiny and subnormal magnitudes, squares that overflow, zero and huge weights), and through
``encode_k``. Also: the compiled path is the one taken where numba is installed (numpy only for the columns the kernel
leaves), and without numba the numpy path writes the same bytes. llama.cpp's own bytes are
tests/test_gguf_kquants.py's, which run the compiled path where numba is installed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamacpp_oracle import needs_library, quantize

from resumerge.inputs.gguf.ggmltypes import Q4_1, Q5_1
from resumerge.outputs.gguf import jit, kquants, legacyweighted, qkxloop, qxloop
from resumerge.outputs.gguf import ksearch as ks

F = np.float32
# every (n, nmax, rmin, rdelta, nstep, mad, v3) of the encoders' ks.qkx calls (test_the_parameters_are_the_encoders
# checks the list against them)
PARAMS = {
    "q2_k": (16, 3, -0.5, 0.1, 15, True, False),
    "q2_k_imatrix": (16, 3, -0.9, 0.05, 36, False, True),
    "q4_k": (32, 15, -1.0, 0.1, 20, False, False),
    "q5_k": (32, 31, -0.5, 0.1, 15, False, False),
    "q4_k_imatrix": (32, 15, -0.9, 0.05, 36, False, True),
    "q5_k_imatrix": (32, 31, -0.9, 0.05, 36, False, True),
}
ENCODERS = {"Q2_K": 10, "Q4_K": 12, "Q5_K": 13}


@pytest.fixture
def kernel() -> Callable[..., Any]:
    """The compiled search (the test skips without numba)."""
    found = qkxloop._kernel()
    if found is None:
        pytest.skip("numba is not installed")
    return found


@pytest.fixture
def no_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba as if not installed (every compiled search, qxloop's too, then takes numpy's path)."""
    monkeypatch.setattr(jit, "numba_module", lambda: None)


def search(x: np.ndarray, w: np.ndarray, name: str, fn: Callable[..., Any] = ks.qkx) -> list[np.ndarray]:
    """``fn``'s (scale, offset, codes) of ``x``, ``w`` with ``name``'s parameters, as their bits."""
    _, nmax, rmin, rdelta, nstep, mad, v3 = PARAMS[name]
    with np.errstate(all="ignore"):  # the numpy path overflows at float32's ends, as encode_k lets it
        found = fn(x, w, nmax, rmin, rdelta, nstep, mad=mad, v3=v3)
    return [np.asarray(part, dtype=F).view(np.uint32) for part in found]


def assert_same(x: np.ndarray, w: np.ndarray, name: str) -> None:
    """The compiled search's bits are the numpy path's, column by column."""
    fast, slow = search(x, w, name), search(x, w, name, ks.qkx_numpy)
    for label, a, b in zip(("scale", "offset", "codes"), fast, slow, strict=True):
        bad = np.flatnonzero((a != b).reshape(-1, x.shape[1]).any(axis=0))
        assert bad.size == 0, f"{name}: {label} differs in columns {bad[:8]}: {x[:, bad[:1]].T}, {w[:, bad[:1]].T}"


def column(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """One adversarial sub-block of ``n`` values (``kind`` 0..17)."""
    normal = rng.standard_normal(n)
    if kind == 0:
        return np.zeros(n, dtype=F)
    if kind == 1:  # flat: every value the same (negative: the min is not clamped to 0)
        return np.full(n, -abs(F(normal[0])), dtype=F)
    if kind == 2:  # signed zeros
        return np.where(rng.random(n) < 0.5, F(0), F(-0.0)).astype(F)
    if kind == 3:  # one-ulp neighbours: the span one ulp, its inverse beyond nearest_int's exact range
        v = F(-1 - rng.random())
        return np.where(rng.random(n) < 0.5, v, np.nextafter(v, F(0))).astype(F)
    if kind == 4:  # ties between candidates: a coarse grid, so several candidates fit equally
        return (rng.integers(-4, 5, n) * 0.25).astype(F)
    if kind == 5:
        return rng.integers(0, 4, n).astype(F)
    if kind == 6:  # huge: the sums of squares overflow
        return (normal * 1e37).astype(F)
    if kind == 7:
        return (normal * 1e20).astype(F)
    if kind == 8:  # tiny and subnormal: inverse scales overflow
        return (normal * 1e-38).astype(F)
    if kind == 9:
        return (normal * 1e-43).astype(F)
    if kind == 10:  # far from 0 in a narrow band
        return (-np.abs(normal) - 100).astype(F)
    if kind == 11:  # one value, zeros elsewhere
        one = np.zeros(n, dtype=F)
        one[rng.integers(n)] = F(normal[0])
        return one
    if kind == 12:  # every magnitude at once
        return (normal * 10.0 ** rng.uniform(-45, 38, n)).astype(F)
    if kind == 13:
        return np.full(n, F(3e38) * F(rng.choice([-1, 1])), dtype=F)
    if kind == 14:  # the largest values of both signs: max - min overflows
        return np.resize(np.array([-3e38, 3e38], dtype=F), n)
    if kind == 15:  # all positive: the min clamped to 0
        return (np.abs(normal) + 0.5).astype(F)
    if kind == 16:  # a real layer's weights
        return (normal * 0.02).astype(F)
    return normal.astype(F)


def weights(kind: int, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Weights for ``x`` as the encoders make them, and adversarial ones (``kind`` 0..6)."""
    if kind == 0:
        return np.abs(x)
    if kind == 1:
        with np.errstate(over="ignore"):
            return (np.sqrt(ks.fsum(x * x) / F(x.shape[0])) + np.abs(x)).astype(F)
    if kind == 2:
        return (rng.random(x.shape) ** 2 * 10).astype(F)
    if kind == 3:  # equal weights: ties
        return np.ones(x.shape, dtype=F)
    if kind == 4:  # a sub-block's weights zero, or some of them
        w = rng.random(x.shape).astype(F)
        w[rng.random(x.shape) < 0.3] = 0
        w[:, rng.integers(x.shape[1])] = 0
        return w
    if kind == 5:
        return (rng.random(x.shape) * 10.0 ** rng.uniform(-40, 38, x.shape)).astype(F)
    return np.full(x.shape, F(1e30), dtype=F)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(PARAMS))
def test_compiled_is_numpy_on_adversarial_columns(kernel: object, name: str, seed: int) -> None:
    n = PARAMS[name][0]
    rng = np.random.default_rng(seed)
    for wkind in range(7):
        x = np.stack([column(int(kind), n, rng) for kind in rng.permutation(np.arange(18).repeat(4))], axis=1)
        assert_same(x, weights(wkind, x, rng), name)


@pytest.mark.parametrize("name", list(PARAMS))
def test_a_zero_code_s_sign_follows_the_whole_search(kernel: object, name: str) -> None:
    """A -0 product's code is -0 through np.rint and +0 through nearest_int's bits, which the numpy path takes for
    every column once any column's argument may leave np.rint's range: a flat column's (which the kernel does not
    search) or a column the kernel leaves to numpy (hypothesis found the first)."""
    n = PARAMS[name][0]
    zeros = np.zeros(n, dtype=F)
    zeros[4], zeros[-1] = F(-0.0), F(0.25)
    for other in (np.full(n, F(-1e6)), column(3, n, np.random.default_rng(0)), np.full(n, F(-1.0))):
        x = np.stack([zeros, other.astype(F), zeros], axis=1)
        assert_same(x, np.abs(x), name)
        assert_same(x, np.ones_like(x), name)


@pytest.mark.parametrize("name", list(PARAMS))
def test_compiled_is_numpy_on_random_columns(kernel: object, name: str) -> None:
    n = PARAMS[name][0]
    rng = np.random.default_rng(7)
    for width in (2, 3, 63, 64, 65, 200, 2048):  # block edges of the kernel
        x = (rng.standard_normal((n, width)) * 0.02).astype(F)
        assert_same(x, np.abs(x), name)
        assert_same(x, (rng.random((n, width)) ** 2 * 10).astype(F), name)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.sampled_from(list(PARAMS)), width=st.integers(2, 5))
def test_compiled_is_numpy_on_any_finite_columns(kernel: object, data: st.DataObject, name: str, width: int) -> None:
    n = PARAMS[name][0]
    values = data.draw(st.one_of(
        st.lists(finite32, min_size=n * width, max_size=n * width),
        # few distinct values: ties, flat sub-blocks
        st.lists(st.sampled_from([0.0, -0.0, 0.25, -0.5, 1.0, 3.0, 1e-45, -3e38]), min_size=n * width,
                 max_size=n * width)))
    x = np.array(values, dtype=F).reshape(n, width)
    w = data.draw(st.one_of(
        st.just(np.abs(x)),
        st.lists(st.floats(0, float(F(3e38)), width=32, allow_subnormal=True), min_size=n * width, max_size=n * width)
        .map(lambda v: np.array(v, dtype=F).reshape(n, width))))
    assert_same(x, w, name)


def test_the_parameters_are_the_encoders(monkeypatch: pytest.MonkeyPatch) -> None:
    """PARAMS are exactly the parameter sets kquants' Q2_K, Q4_K and Q5_K search with (legacyweighted's Q4_1 and
    Q5_1 among them)."""
    seen = set()
    search_of = ks.qkx

    def spy(x: np.ndarray, w: np.ndarray, *args: Any, mad: bool, v3: bool) -> Any:
        seen.add((x.shape[0], *args, mad, v3))
        return search_of(x, w, *args, mad=mad, v3=v3)

    monkeypatch.setattr(ks, "qkx", spy)
    monkeypatch.setattr(legacyweighted, "qkx", spy)
    x = (np.random.default_rng(0).standard_normal((2, 512)) * 0.02).astype(F)
    for code in ENCODERS.values():
        for imatrix in (None, np.ones(512, dtype=F)):
            kquants.encode_k(x, code, imatrix)
    for code in (Q4_1, Q5_1):  # a legacy type's fallback rows with a matrix
        legacyweighted.encode_legacy_weighted(x, code, np.ones(512, dtype=F))
    assert seen == set(PARAMS.values())


def test_compiled_path_is_taken_with_numba(kernel: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba, ks.qkx runs the kernel, numpy only for the columns it leaves, and those columns' results are
    numpy's."""
    taken: list[int] = []
    numpy_path = ks._qkx_numpy  # the numpy path, as qkx hands it the columns the kernel leaves

    def spy(x: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        taken.append(x.shape[1])
        return numpy_path(x, *args, **kwargs)

    rng = np.random.default_rng(3)
    for name in PARAMS:
        n = PARAMS[name][0]
        x = (rng.standard_normal((n, 300)) * 0.02).astype(F)
        w = np.abs(x)
        expected = search(x, w, name, ks.qkx_numpy)
        monkeypatch.setattr(ks, "_qkx_numpy", spy)
        assert all(np.array_equal(a, b) for a, b in zip(search(x, w, name), expected, strict=True))
        assert taken == []
        # one column past nearest_int's exact range (a span of one ulp): numpy's, searched alone
        x[:, 5] = column(3, n, rng)
        monkeypatch.setattr(ks, "_qkx_numpy", numpy_path)
        expected = search(x, w, name, ks.qkx_numpy)
        monkeypatch.setattr(ks, "_qkx_numpy", spy)
        assert all(np.array_equal(a, b) for a, b in zip(search(x, w, name), expected, strict=True))
        assert taken == [1]
        # and three: a span of one ulp, a value not finite, max − min overflowing
        x[:, 7] = F(np.inf)
        x[:, 9] = np.resize(np.array([-3e38, 3e38], dtype=F), n)
        monkeypatch.setattr(ks, "_qkx_numpy", numpy_path)
        expected = search(x, w, name, ks.qkx_numpy)
        monkeypatch.setattr(ks, "_qkx_numpy", spy)
        taken.clear()
        assert all(np.array_equal(a, b) for a, b in zip(search(x, w, name), expected, strict=True))
        assert taken == [3]
        taken.clear()
        monkeypatch.setattr(ks, "_qkx_numpy", numpy_path)
    # and through the encoders, on a real layer's values
    monkeypatch.setattr(ks, "_qkx_numpy", spy)
    x = (rng.standard_normal((4, 1024)) * 0.02).astype(F)
    for code in ENCODERS.values():
        kquants.encode_k(x, code, None)
        kquants.encode_k(x, code, (rng.random(1024) * 5).astype(F))
    assert taken == []


def test_one_compiled_kernel_for_every_parameter_set_releasing_the_gil(kernel: Any) -> None:
    """Every parameter set (numpy's integers and floats too) is one signature: compiled (or loaded) once a
    process; and the merge's workers search in parallel."""
    x = (np.random.default_rng(1).standard_normal((32, 8)) * 0.02).astype(F)
    for name, (n, nmax, rmin, rdelta, nstep, mad, v3) in PARAMS.items():
        search(x[:n], np.abs(x[:n]), name)
        ks.qkx(x[:n], np.abs(x[:n]), np.int64(nmax), F(rmin), np.float64(rdelta), np.int32(nstep), mad=np.bool_(mad),
               v3=v3)
    assert len(kernel.signatures) == 1
    assert kernel.targetoptions["nogil"] is True


def encoded(x: np.ndarray, imatrix: np.ndarray | None) -> dict[str, bytes]:
    with np.errstate(all="ignore"):
        return {name: kquants.encode_k(x, code, imatrix).tobytes() for name, code in ENCODERS.items()}


def awkward_rows(seed: int) -> np.ndarray:
    """Super-blocks of real-layer values with adversarial sub-blocks (every kind of :func:`column`) among them."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((8, 1024)) * 0.02).astype(F)
    flat = x.reshape(-1, 16)
    for at, kind in zip(rng.choice(len(flat), 60, replace=False), np.arange(60) % 18, strict=True):
        flat[at] = column(int(kind), 16, rng)
    return x


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
def test_encoders_bytes_without_numba_are_the_compiled_ones(kernel: object, weighted: bool,
                                                            request: pytest.FixtureRequest) -> None:
    rng = np.random.default_rng(11)
    x = awkward_rows(11)
    imatrix = (rng.random(1024) ** 3 * 20).astype(F) if weighted else None
    compiled = encoded(x, imatrix)
    request.getfixturevalue("no_numba")
    assert qkxloop._kernel() is None and qxloop.kernels() is None
    assert encoded(x, imatrix) == compiled


def test_qkx_without_numba_is_the_numpy_path(no_numba: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel: ks.qkx is qkx_numpy, whole."""
    assert qkxloop._kernel() is None
    calls = []
    numpy_path = ks.qkx_numpy
    monkeypatch.setattr(ks, "qkx_numpy", lambda *a, **k: calls.append(1) or numpy_path(*a, **k))
    x = (np.random.default_rng(0).standard_normal((32, 16)) * 0.02).astype(F)
    search(x, np.abs(x), "q4_k")
    assert calls == [1]


def test_arrays_the_kernel_does_not_take_go_to_numpy(kernel: object) -> None:
    """A strided view, float64: numpy's path, its own bits; a lone column is the kernel's, numpy's bits too."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((32, 40)) * 0.02).astype(F)
    for part in (x[:, ::2], x.astype(np.float64)):
        assert qkxloop.qkx(part, np.abs(part), 15, -1.0, 0.1, 20, mad=False, v3=False,
                           rest=ks.qkx_numpy) is None
    for part in (x[:, ::2], x[:, :1].copy()):
        fast, slow = search(part, np.abs(part), "q4_k"), search(part, np.abs(part), "q4_k", ks.qkx_numpy)
        assert all(np.array_equal(a, b) for a, b in zip(fast, slow, strict=True))


@pytest.mark.parametrize("seeds", [range(0, 30), range(30, 60)])
def test_a_single_block_tensor_has_llama_cpp_s_bytes(seeds: range) -> None:
    """One super-block (one legacy block) a tensor: its sums over a lone column of sub-blocks in index order, as C
    sums, where numpy's reduction of a (n, 1) array is pairwise (Q5_K with a matrix and Q5_1's differed at 1 and 2
    of the first 40 such tensors)."""
    needs_library()
    for seed in seeds:
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal((1, 256)) * 10.0 ** rng.integers(-3, 3)).astype(F)
        imatrix = (rng.random(256) ** 2 * 10).astype(F)
        for code in (10, 11, 12, 13, 14):
            for weights_of in (None, imatrix):
                assert np.array_equal(kquants.encode_k(x, code, weights_of), quantize(x, code, weights_of)), code
        block = x[:, :32].copy()
        for code in (Q4_1, Q5_1):
            assert np.array_equal(legacyweighted.encode_legacy_weighted(block, code, imatrix[:32]),
                                  quantize(block, code, imatrix[:32])), (code, seed)


def test_compiled_without_a_writable_cache_directory(kernel: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where numba finds no cache directory it can write (its locators all refuse), jit.compiled compiles
    without caching rather than raising, and no warning escapes (the suite's warnings are errors)."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # its older name
    monkeypatch.setattr(impl, "_locator_classes", [])

    def add_one(v: np.ndarray) -> np.ndarray:
        return v + np.float32(1)

    with pytest.raises(RuntimeError, match="no locator"):  # numba's own refusal, which compiled() catches
        jit.numba_module().njit(cache=True)(add_one)  # type: ignore[union-attr]
    compiled_add = jit.compiled(add_one)
    assert compiled_add is not None
    assert compiled_add(np.zeros(3, dtype=F)).tolist() == [1.0, 1.0, 1.0]


def _halved_ratio(a: float, b: float) -> float:
    return a / b * np.float32(0.5)


def _ratios(x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = _halved_ratio(x[i], y[i])


def _ratio_sum(x: np.ndarray, y: np.ndarray) -> float:
    total = np.float32(0)
    for i in range(x.shape[0]):
        total += _halved_ratio(x[i], y[i])
    return total


def test_kernels_call_their_helpers_compiled_as_the_kernels_are(kernel: object, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A step written once for several loops (``lazy_kernels(..., helpers=)``, as qkxloop's ``_level``) is
    compiled where a kernel calls it, with the kernels' float semantics (a division by zero gives inf or NaN as C's
    does, not ZeroDivisionError), and two kernel sets may share one helper."""
    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))  # the test's kernels cached there, not beside it
    x = np.array([1, 2, 0, -3], dtype=F)
    y = np.array([0, 1, 0, 4], dtype=F)
    with np.errstate(all="ignore"):
        want = x / y * F(0.5)
    ratios = jit.lazy_kernels(lambda fn: fn, _ratios, helpers=(_halved_ratio,))()
    summed = jit.lazy_kernels(lambda fn: fn, _ratio_sum, helpers=(_halved_ratio,))()
    assert ratios is not None and summed is not None
    out = np.zeros(4, dtype=F)
    ratios(x, y, out)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert np.isnan(summed(x, y))
    assert summed(x[1:2], y[1:2]) == F(1)

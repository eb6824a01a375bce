"""The compiled symmetric K-quant searches (``outputs/gguf/qxloop``) write the numpy path's results bit for bit:
``qx_lazy``/``qx`` (Q6_K, Q3_K with importance and its scales' own search), ``q3`` (Q3_K without) and ``qp`` (the
importance paths' sub-block scales, Q2_K/Q4_K/Q5_K), at every parameter set the encoders use, on random columns
and on the adversarial ones (signs tied at the largest magnitude, all zero, amax under EPS and its one-ulp
neighbours, huge, tiny and subnormal magnitudes, zero importance weights); the compiled path is the one taken when
numba is there, and without numba the encoders write the same bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from resumerge.outputs.gguf import jit, ksearch, qxloop
from resumerge.outputs.gguf.kquants import encode_k

pytest.importorskip("numba")

F = np.float32
EPS = ksearch.EPS
# (search, rows a column, nmax, weighted): every call the K encoders make (kquants.py)
QX = [(16, 32, False), (16, 32, True), (16, 4, True)]  # Q6_K plain/imatrix, Q3_K imatrix (and its scales' qx)
QP = [(16, 15), (8, 63)]  # Q2_K's scales and mins; Q4_K's and Q5_K's


@contextmanager
def numpy_path() -> Iterator[None]:
    """The searches as they run where numba is missing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jit, "numba_module", lambda: None)
        yield


def bits(a: np.ndarray) -> np.ndarray:
    """An array's bytes as integers of its width (so -0.0 and NaN payloads count)."""
    return a.view({4: np.uint32, 1: np.uint8, 2: np.uint16}[a.dtype.itemsize]) if a.dtype != bool else a


def assert_same(ours: Any, theirs: Any, label: object) -> None:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, label
    assert np.array_equal(bits(ours), bits(theirs)), (label, np.argwhere(bits(ours) != bits(theirs))[:5].tolist())


def both(search: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    with np.errstate(all="ignore"):
        compiled = search(*args)
        with numpy_path():
            plain = search(*args)
    return compiled, plain


def check_qx(x: np.ndarray, nmax: int, w: np.ndarray | None) -> None:
    (scale, codes_at), (scale0, codes_at0) = both(ksearch.qx_lazy, x, nmax, w)
    assert_same(scale, scale0, "scale")
    everything = np.arange(x.shape[1])
    some = everything[::3]
    with np.errstate(all="ignore"):
        assert_same(codes_at(everything), codes_at0(everything), "codes")
        assert_same(codes_at(some), codes_at0(some), "some codes")
        assert_same(ksearch.qx(x, nmax, w)[1], codes_at0(everything), "qx")


def check_q3(x: np.ndarray) -> None:
    (scale, codes_at), (scale0, codes_at0) = both(ksearch.q3, x, 4)
    assert_same(scale, scale0, "scale")
    everything = np.arange(x.shape[1])
    assert_same(codes_at(everything), codes_at0(everything), "codes")


def check_qp(x: np.ndarray, nmax: int, w: np.ndarray) -> None:
    (scale, codes), (scale0, codes0) = both(ksearch.qp, x, nmax, w)
    assert_same(scale, scale0, "scale")
    assert_same(codes, codes0, "codes")


def adversarial(n: int, seed: int, *, finite: bool = True) -> np.ndarray:
    """Columns of ``n`` values at every edge the searches have, several of each, each kind at several scales; and
    unless ``finite``, columns holding NaN or inf."""
    rng = np.random.default_rng(seed)
    cols: list[np.ndarray] = []

    def add(c: np.ndarray) -> None:
        cols.append(np.asarray(c, dtype=F))

    for mag in (1.0, 0.02, 300.0, 1e12, 1e18, 1e20, 3e38, 1e-20, 1e-30, 1e-38, 1e-40, 1e-44):
        for _ in range(3):
            normal = rng.standard_normal(n).clip(-1, 1)  # finite at 3e38 too
            add(normal * mag)
            add(np.abs(normal) * mag)  # all positive (qp's scales)
            tied = normal * 0.5 * mag  # +m and -m both at the largest magnitude, either first
            i, j = rng.choice(n, 2, replace=False)
            tied[i], tied[j] = mag, -mag
            add(tied)
    add(np.zeros(n))
    add(-np.zeros(n))
    for edge in (EPS, np.nextafter(EPS, F(0)), np.nextafter(EPS, F(1)), EPS / 2, -EPS):
        add(np.full(n, edge))
        add(rng.standard_normal(n).clip(-1, 1) * edge)
        one = np.zeros(n, dtype=F)
        one[rng.integers(n)] = edge
        add(one)
    for v in (F(0.375), F(1), F(-2.5), np.nextafter(F(1), F(2))):  # constants, and one-ulp neighbours
        add(np.full(n, v))
        add(np.nextafter(np.full(n, v), np.where(rng.random(n) < 0.5, F(-np.inf), F(np.inf)).astype(F)))
    add(np.linspace(-1, 1, n))
    add(rng.integers(-2, 3, n))
    subnormal = np.float32(1.4e-45) * rng.integers(-5, 6, n).astype(F)
    add(subnormal)
    mixed = rng.standard_normal(n).astype(F)
    mixed[::3] *= F(1e18)
    mixed[1::4] *= F(1e-40)
    add(mixed)
    add(rng.standard_normal(n) * np.float32(10.0) ** rng.integers(-44, 38, n).astype(F))
    if not finite:  # the sub-block scales the second searches take (qx of Q3_K's, qp) overflow where x does
        for bad in (F(np.nan), F(np.inf), F(-np.inf)):
            for at in (0, n // 2):
                c = rng.standard_normal(n).astype(F)
                c[at] = bad
                add(c)
        add(np.full(n, np.nan))
    return np.ascontiguousarray(np.stack(cols, axis=1))


def weights_for(x: np.ndarray, seed: int) -> list[np.ndarray]:
    """Importance weights for ``x``: random, some zero, all zero in some columns, and at float32's ends."""
    rng = np.random.default_rng(seed)
    w = (rng.random(x.shape) ** 3 * 20).astype(F)
    w[rng.random(x.shape) < 0.2] = 0
    w[:, ::5] = 0
    with np.errstate(over="ignore"):  # the encoders' own weights overflow too where x does (sqrt(sigma2 + x²))
        kinds = np.sqrt(x * x + F(0.5))
    single = np.zeros_like(w)  # one weight a column: the descent's reduced sums reach 0 exactly
    single[rng.integers(x.shape[0], size=x.shape[1]), np.arange(x.shape[1])] = F(1.5)
    return [w, np.zeros_like(w), (w * F(1e30)).astype(F), (w * F(1e-30)).astype(F), kinds, single]


def test_the_compiled_searches_are_taken_where_numba_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba, none of the numpy searches' own steps run (each raises here), and the kernels exist."""
    assert qxloop.kernels() is not None

    def never(*_: object, **__: object) -> None:
        raise AssertionError("the numpy path ran")

    for name in ("largest", "descend", "scan_max", "tame"):
        monkeypatch.setattr(ksearch, name, never)
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(F)
    ksearch.qx_lazy(x, 32, None)[1](np.arange(64))
    ksearch.qp(np.abs(x), 15, np.abs(x))
    ksearch.q3(x, 4)[1](np.arange(64))


def test_without_numba_there_are_no_kernels() -> None:
    with numpy_path():
        assert qxloop.kernels() is None


@pytest.mark.parametrize(("n", "nmax", "weighted"), QX)
def test_qx_is_the_numpy_path_s_on_every_edge(n: int, nmax: int, weighted: bool) -> None:
    for seed in range(2):
        x = adversarial(n, seed, finite=not weighted)  # weighted: Q3_K's scales' own search too
        for w in weights_for(x, seed) if weighted else [None]:
            check_qx(x, nmax, w)


def test_q3_is_the_numpy_path_s_on_every_edge() -> None:
    for seed in range(2):
        check_q3(adversarial(16, seed))
    # columns whose descent still moves in the fifth pass (tests/test_gguf_kquants.py), among ordinary ones
    x = np.random.default_rng(0).standard_normal((16, 65536)).astype(F)
    check_q3(np.ascontiguousarray(x[:, 36000:45000]))


@pytest.mark.parametrize(("n", "nmax"), QP)
def test_qp_is_the_numpy_path_s_on_every_edge(n: int, nmax: int) -> None:
    for seed in range(2):
        x = adversarial(n, seed, finite=False)
        for w in weights_for(x, seed):
            check_qp(x, nmax, w)
            check_qp(np.abs(x), nmax, w)


def test_the_searches_are_the_numpy_path_s_on_wide_random_rows() -> None:
    """A chunk's width, as the encoders search it (4096 sub-blocks)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 4096)) * 0.02).astype(F)
    w = (rng.random((16, 4096)) ** 3 * 20).astype(F)
    for n, nmax, weighted in QX:
        check_qx(x[:n], nmax, w[:n] if weighted else None)
    check_q3(x)
    for n, nmax in QP:
        check_qp(np.ascontiguousarray(np.abs(x[:n])), nmax, np.ascontiguousarray(w[:n]))


floats = st.floats(width=32, allow_nan=False, allow_infinity=False)
weights = st.floats(0, 1e6, width=32)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(F, (16, 6), elements=floats), hnp.arrays(F, (16, 6), elements=weights),
       st.sampled_from(QX))
def test_qx_is_the_numpy_path_s_on_any_column(x: np.ndarray, w: np.ndarray, case: tuple[int, int, bool]) -> None:
    n, nmax, weighted = case
    check_qx(x[:n], nmax, w[:n] if weighted else None)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(F, (16, 6), elements=floats))
def test_q3_is_the_numpy_path_s_on_any_column(x: np.ndarray) -> None:
    check_q3(x)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(F, (16, 6), elements=floats), hnp.arrays(F, (16, 6), elements=weights), st.sampled_from(QP),
       st.booleans())
def test_qp_is_the_numpy_path_s_on_any_column(x: np.ndarray, w: np.ndarray, case: tuple[int, int],
                                              positive: bool) -> None:
    n, nmax = case
    x = np.ascontiguousarray(np.abs(x[:n]) if positive else x[:n])
    check_qp(x, nmax, np.ascontiguousarray(w[:n]))


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("kind", [10, 11, 12, 13, 14], ids=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_the_encoders_write_the_same_bytes_without_numba(kind: int, weighted: bool) -> None:
    rng = np.random.default_rng(kind)
    x = rng.standard_normal((24, 512)).astype(F)
    x[1] *= F(1e-20)
    x[2] = 0
    x[3, ::7] *= F(1e18)
    x[4] *= F(1e-40)
    x[5, :256] = np.tile(np.array([1, -1] * 8, F), 16) * np.repeat(np.array([1, -1] * 8, F), 16)
    importance = (rng.random(512) ** 3 * 20).astype(F) if weighted else None
    if importance is not None:
        importance[:40] = 0
    compiled, plain = both(encode_k, x, kind, importance)
    assert_same(compiled, plain, kind)

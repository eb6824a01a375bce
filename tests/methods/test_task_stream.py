"""The rank-window methods over row chunks: bit-identical to the whole-tensor path for every chunking."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from methods.test_ranking import whole_window
from resumerge.merge.methods import MergeContext, get_method, ranking
from resumerge.merge.methods.rankstream import StreamedWindow

STREAMED = ["ties", "breadcrumbs", "breadcrumbs_ties"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so NaN payloads and the sign of zero count in comparisons."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def cuts(rows: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive row ranges covering ``rows``, their sizes taken from ``sizes`` in turn."""
    out, first = [], 0
    for size in itertools.cycle(sizes):
        if first >= rows:
            return out
        out.append((first, min(rows, first + size)))
        first += size
    raise AssertionError("unreachable")


def contexts(tensors: Sequence[torch.Tensor], parts: list[tuple[int, int]], base: int,
             model_params: Sequence[Mapping[str, Any]], params: Mapping[str, Any]) -> list[MergeContext]:
    return [MergeContext([t[a:b] for t in tensors], base, model_params, params) for a, b in parts]


def run_streamed(method: str, tensors: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]],
                 params: Mapping[str, Any], sizes: Sequence[Sequence[int]], base: int = 0) -> torch.Tensor:
    """Drive the method's RowStream as the engine does; pass k is cut by ``sizes[k]`` (the last one repeats)."""
    spec = get_method(method)
    assert spec is not None and spec.streamed is not None
    model_params, params = spec.bind(model_params, params, base)  # as the planner resolves them
    stream = spec.streamed(tuple(tensors[0].shape), base, model_params, params)
    assert stream is not None
    rows = tensors[0].shape[0]
    k = 0
    while stream.wants(k):
        for ctx in contexts(tensors, cuts(rows, sizes[min(k, len(sizes) - 1)]), base, model_params, params):
            stream.observe(k, ctx)
        k += 1
    applied = [stream.apply(ctx) for ctx in contexts(tensors, cuts(rows, sizes[-1]), base, model_params, params)]
    return torch.cat(applied)


def whole(method: str, tensors: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]],
          params: Mapping[str, Any], base: int = 0) -> torch.Tensor:
    spec = get_method(method)
    assert spec is not None
    return spec.fn(MergeContext(list(tensors), base, *spec.bind(model_params, params, base)))


def assert_chunkings_agree(method: str, tensors: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]],
                           params: Mapping[str, Any] | None = None) -> None:
    params = params or {}
    expected = whole(method, [t.clone() for t in tensors], model_params, params)
    rows = tensors[0].shape[0]
    for sizes in ([[1]], [[3, 1, 2]], [[rows]], [[2], [5], [1, 4]], [[7], [rows]]):
        got = run_streamed(method, [t.clone() for t in tensors], model_params, params, sizes)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected)), f"{method} {params} {model_params} chunks {sizes}"


def inputs(dtype: torch.dtype, shape: tuple[int, ...], seed: int, levels: int | None = None) -> list[torch.Tensor]:
    """Base and two models; with ``levels`` the task vectors take few distinct magnitudes (ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g).to(dtype)
    out = [base]
    for _ in range(2):
        if levels is None:
            delta = torch.randn(shape, generator=g) * 0.01
        else:
            delta = torch.randint(-levels, levels + 1, shape, generator=g).float() * 0.25
        # Built in the compute dtype so that θ − B gives back these exact deltas' ties where representable.
        out.append((base.double() + delta.double()).to(dtype) if levels is None else base + delta.to(dtype))
    return out


def model_params(density: float, gamma: float = 0.01,
                 weights: tuple[float, float] = (0.6, 0.4)) -> list[dict[str, Any]]:
    return [{}, *({"weight": w, "density": density, "gamma": gamma} for w in weights)]


@pytest.mark.parametrize("method", STREAMED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_every_chunking_gives_the_whole_tensor_bits(method: str, dtype: torch.dtype) -> None:
    for seed, levels in ((1, None), (2, 3)):
        tensors = inputs(dtype, (13, 9), seed, levels)
        for density in (0.0, 1e-6, 0.3, 0.5, 0.97, 1.0):
            assert_chunkings_agree(method, tensors, model_params(density, gamma=0.05))


@pytest.mark.parametrize("method", ["breadcrumbs", "breadcrumbs_ties"])
def test_gamma_edges(method: str) -> None:
    tensors = inputs(torch.bfloat16, (11, 6), 3, levels=2)
    for density, gamma in itertools.product((0.0, 0.2, 0.6, 0.99), (0.0, 0.01, 0.4, 1.0)):
        assert_chunkings_agree(method, tensors, model_params(density, gamma))


@pytest.mark.parametrize("method", STREAMED)
def test_float32_ties_inside_one_coarse_bucket(method: str) -> None:
    # Magnitudes 1 + k·2⁻²³ share their high 16 bits, so only the second (fine) pass tells them apart; each value
    # repeats, so runs of equal keys straddle the window's ends.
    g = torch.Generator().manual_seed(4)
    base = torch.zeros(17, 5)
    steps = torch.randint(0, 6, (2, 17, 5), generator=g).float() * 2.0**-23
    signs = torch.randint(0, 2, (2, 17, 5), generator=g).float() * 2 - 1
    tensors = [base, *(signs[i] * (1 + steps[i]) for i in range(2))]
    assert len({int(k) >> 16 for k in ranking.magnitude_keys(tensors[1].abs()).reshape(-1)}) == 1
    for density in (0.1, 0.35, 0.5, 0.8):
        assert_chunkings_agree(method, tensors, model_params(density, gamma=0.1))


@pytest.mark.parametrize("method", STREAMED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_inf_signed_zeros_and_all_equal(method: str, dtype: torch.dtype) -> None:
    base = torch.zeros(6, 4, dtype=dtype)
    odd = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1.0, -1.0, 2.0] * 3, dtype=dtype)
    for density in (0.0, 0.25, 0.5, 0.9):
        assert_chunkings_agree(method, [base, odd.reshape(6, 4), -odd.flip(0).reshape(6, 4)], model_params(density))
        equal = torch.full((6, 4), -0.5, dtype=dtype)
        assert_chunkings_agree(method, [base, equal, -equal], model_params(density))


@pytest.mark.parametrize("method", STREAMED)
def test_one_dimensional_tensors_stream_one_entry_per_row(method: str) -> None:
    tensors = [t.reshape(-1) for t in inputs(torch.bfloat16, (5, 5), 5, levels=2)]
    assert_chunkings_agree(method, tensors, model_params(0.4, gamma=0.1))


def test_params_and_defaults_reach_the_stream() -> None:
    tensors = inputs(torch.float32, (9, 4), 6, levels=3)
    per_model = [{}, {"weight": 0.7, "density": 0.4}, {"weight": -0.2, "density": 0.6}]  # defaults: gamma
    for method in STREAMED:
        for params in ({}, {"normalize": True, "lambda": 0.5}, {"normalize": False}, {"rescale": False}):
            assert_chunkings_agree(method, tensors, per_model, params)


def test_a_base_alone_is_copied() -> None:
    base = torch.randn(4, 3)
    assert torch.equal(run_streamed("ties", [base], [{}], {}, [[1]]), base)


def test_missing_base_and_empty_tensors_stay_whole_tensor() -> None:
    for method in STREAMED:
        spec = get_method(method)
        assert spec is not None and spec.streamed is not None
        per_model = model_params(0.5)
        assert spec.streamed((4, 4), None, *spec.bind(per_model, {}, None)) is None
        assert spec.streamed((0, 4), 0, *spec.bind(per_model, {}, 0)) is None
    for method in ("task_arithmetic", "slerp"):
        spec = get_method(method)
        assert spec is not None and spec.streamed is None


@pytest.mark.parametrize("method", STREAMED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rescale_streams_with_the_one_chunk_bits(method: str, dtype: torch.dtype) -> None:
    # The rescale's L1 norms are ordered sums fed chunk by chunk in their own statistics pass; tied magnitudes
    # (levels) make the windows cut runs of equal keys, and density 1 / 0 gives trivial windows, still rescaled.
    tensors = inputs(dtype, (11, 7), 9, levels=4)
    for densities in ((0.4, 0.7), (1.0, 0.0)):
        per_model = [{}, {"weight": 0.6, "density": densities[0]}, {"weight": 0.5, "density": densities[1]}]
        assert_chunkings_agree(method, tensors, per_model, {"rescale": True})


def test_hand_computed_ties_rescale_restores_each_l1_norm() -> None:
    # δ = [[3, -1], [0.5, 2]] keeps 3 and 2 (density 0.5): |δ|₁ = 6.5, kept 5, so both scale by 1.3.
    base = torch.zeros(2, 2)
    delta = torch.tensor([[3.0, -1.0], [0.5, 2.0]])
    params = [{}, {"weight": 1.0, "density": 0.5}]
    expected = torch.tensor([[3.0 * 1.3, 0.0], [0.0, 2.0 * 1.3]])
    for sizes in ([[1]], [[2]]):
        got = run_streamed("ties", [base, delta], params, {"rescale": True}, sizes)
        assert torch.allclose(got, expected, rtol=1e-6, atol=0)


def test_hand_computed_ties_keeps_the_first_of_equal_magnitudes_across_chunks() -> None:
    # δ₁ = [[2, -1], [1, 1], [-1, 3]]: density 0.5 keeps 3 of 6 — 3 and 2, then the first of the four 1s (index 1,
    # in the first chunk); the 1s in later chunks are dropped (a dropped -1 is -0.0 until the sum over models adds
    # it to +0.0).
    base = torch.zeros(3, 2)
    delta = torch.tensor([[2.0, -1.0], [1.0, 1.0], [-1.0, 3.0]])
    params = [{}, {"weight": 1.0, "density": 0.5}]
    got = run_streamed("ties", [base, delta], params, {}, [[1]])
    assert torch.equal(bits(got), bits(torch.tensor([[2.0, -1.0], [0.0, 0.0], [0.0, 3.0]])))


def test_hand_computed_breadcrumbs_window_keeps_the_last_of_equal_low_magnitudes() -> None:
    # Ascending magnitudes 1(i1) 1(i2) 1(i3) 2 3 4: density 0.5, gamma 1/6 skips 6 − 3 − 1 = 2, so the window is
    # sort positions [2, 5): the third 1 (index 3), 2 and 3; the outlier 4 goes.
    base = torch.zeros(3, 2)
    delta = torch.tensor([[2.0, 1.0], [-1.0, 1.0], [4.0, 3.0]])
    params = [{}, {"weight": 1.0, "density": 0.5, "gamma": 1 / 6 + 1e-9}]
    got = run_streamed("breadcrumbs", [base, delta], params, {}, [[2], [1]])
    assert torch.equal(got, torch.tensor([[2.0, 0.0], [-0.0, 1.0], [0.0, 3.0]]))


def test_streamed_window_matches_the_window_over_one_chunk_on_raw_keys() -> None:
    g = torch.Generator().manual_seed(7)
    for span, shift in ((40, None), (1 << 31, None), (8, 16)):
        keys = torch.randint(0, span, (257,), generator=g, dtype=torch.int64).to(torch.int32)
        if shift is not None:
            keys <<= shift
        for start, stop, descending in ((0, 1, True), (5, 200, False), (100, 257, False), (0, 128, True)):
            window = StreamedWindow(257, start, stop, descending=descending, shift=shift)
            k = 0
            while window.wants(k):
                for a, b in cuts(257, [k + 10]):
                    window.observe(k, keys[a:b])
                k += 1
            got = torch.cat([window.mask(keys[a:b], torch.bool) for a, b in cuts(257, [33, 1])])
            assert torch.equal(got, whole_window(keys, start, stop, descending=descending))


def test_streamed_window_refuses_misuse() -> None:
    window = StreamedWindow(10, 2, 5, descending=True)
    with pytest.raises(ValueError, match="statistics"):
        window.mask(torch.zeros(10, dtype=torch.int32), torch.bool)
    with pytest.raises(ValueError, match="in order"):
        window.wants(1)
    assert window.wants(0)
    window.observe(0, torch.arange(10, dtype=torch.int32))
    assert not window.wants(1)  # one chunk: the first pass guessed the ends' buckets right
    with pytest.raises(ValueError, match="not asked"):
        window.observe(1, torch.arange(10, dtype=torch.int32))
    window.mask(torch.arange(10, dtype=torch.int32), torch.bool)
    with pytest.raises(ValueError, match="masks asked"):
        window.mask(torch.arange(1, dtype=torch.int32), torch.bool)


def _window_passes(keys: torch.Tensor, start: int, stop: int, rows: int) -> tuple[int, torch.Tensor]:
    window = StreamedWindow(keys.numel(), start, stop, descending=False)
    k = 0
    while window.wants(k):
        for a, b in cuts(keys.numel(), [rows]):
            window.observe(k, keys[a:b])
        k += 1
    return k, torch.cat([window.mask(keys[a:b], torch.bool) for a, b in cuts(keys.numel(), [rows])])


def test_float32_ends_guessed_from_the_first_chunk_save_the_second_pass() -> None:
    g = torch.Generator().manual_seed(8)
    alike = ranking.magnitude_keys(torch.randn(40_000, generator=g).abs())
    passes, mask = _window_passes(alike, 10_000, 30_000, 4_000)
    assert passes == 1 and torch.equal(mask, whole_window(alike, 10_000, 30_000, descending=False))
    # Rows unlike the first chunk (ten times larger beyond it) put the ends elsewhere: a second pass finds them.
    unlike = ranking.magnitude_keys(torch.cat([alike[:4_000].view(torch.float32),
                                               alike[4_000:].view(torch.float32) * 10]))
    passes, mask = _window_passes(unlike, 10_000, 30_000, 4_000)
    assert passes == 2 and torch.equal(mask, whole_window(unlike, 10_000, 30_000, descending=False))

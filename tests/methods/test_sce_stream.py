"""SCE over row chunks: bit-identical to the whole-tensor path for every chunking, window and dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from methods.test_task_stream import bits, contexts, cuts, run_streamed, whole
from resumerge.merge.methods import get_method
from resumerge.merge.methods.sce_steps import energy_weights

CHUNKINGS: list[list[list[int]]] = [[[1]], [[3, 1, 2]], [[1000]], [[2], [5], [7], [1, 4]]]


def inputs(dtype: torch.dtype, shape: tuple[int, ...], seed: int, models: int = 3) -> list[torch.Tensor]:
    # Task vectors that are exactly zero at a third of the positions (zero variance there, which the window's
    # count leaves out) and tie often in half precision.
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    keep = torch.rand(shape, generator=g) > 0.33
    return [t.to(dtype) for t in [base, *(base + 0.1 * torch.randn(shape, generator=g) * keep for _ in range(models))]]


def assert_streams_like_whole(tensors: list[torch.Tensor], params: dict[str, Any]) -> None:
    model_params: list[dict[str, Any]] = [{} for _ in tensors]
    expected = whole("sce", [t.clone() for t in tensors], model_params, params)
    for sizes in CHUNKINGS:
        got = run_streamed("sce", [t.clone() for t in tensors], model_params, params, sizes)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected)), (params, sizes, tensors[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("topk", [0.0, 0.004, 0.3, 0.77, 1.0])
def test_chunks_give_the_whole_tensors_bits(dtype: torch.dtype, topk: float) -> None:
    tensors = inputs(dtype, (29, 31), seed=int(topk * 100))
    assert_streams_like_whole(tensors, {"select_topk": topk})
    assert_streams_like_whole(tensors, {"select_topk": topk, "int8_mask": True})


def test_three_dimensional_rows_two_models_and_float64_without_a_window() -> None:
    assert_streams_like_whole(inputs(torch.float32, (9, 4, 6), seed=3, models=2), {"select_topk": 0.5})
    assert_streams_like_whole(inputs(torch.float64, (17, 5), seed=4), {})


def test_the_window_cuts_through_equal_variances_in_index_order() -> None:
    # Every position has the same variance: the window keeps the first `keep` positions, whatever the chunking.
    base = torch.zeros(12, 10)
    tensors = [base, base + 1.0, base - 1.0, base + 0.0]
    assert_streams_like_whole(tensors, {"select_topk": 0.45})
    out = whole("sce", tensors, [{} for _ in tensors], {"select_topk": 0.45})
    assert bool((out.reshape(-1)[54:] == 0).all())


def test_float64_ranked_by_variance_is_left_whole() -> None:
    spec = get_method("sce")
    assert spec is not None and spec.streamed is not None
    model_params: list[dict[str, Any]] = [{}, {}, {}]
    assert spec.streamed((8, 8), 0, *spec.bind(model_params, {"select_topk": 0.5}, 0), dtype="float64") is None
    assert spec.streamed((8, 8), 0, *spec.bind(model_params, {}, 0), dtype="float64") is not None
    assert spec.streamed((8, 8), 0, *spec.bind(model_params, {"select_topk": 0.5}, 0), dtype="float32") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_energy_weights_are_torch_means_on_one_thread(dtype: torch.dtype) -> None:
    # The ordered energy sums are what torch.mean(dim=1) gives on one thread (mergekit's numbers there), for
    # sizes past one fold of the cascade.
    g = torch.Generator().manual_seed(5)
    stacked = (0.01 * torch.randn(3, 300_007, generator=g)).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        energy = stacked.square().mean(dim=1)
        expected = energy / torch.sum(energy).item()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(energy_weights(stacked)), bits(expected))


def statistics_passes(tensors: list[torch.Tensor], params: dict[str, Any], rows: int) -> int:
    spec = get_method("sce")
    assert spec is not None and spec.streamed is not None
    model_params, bound = spec.bind([{} for _ in tensors], params, 0)
    stream = spec.streamed(tuple(tensors[0].shape), 0, model_params, bound)
    assert stream is not None
    k = 0
    while stream.wants(k):
        for ctx in contexts(tensors, cuts(tensors[0].shape[0], [rows]), 0, model_params, bound):
            stream.observe(k, ctx)
        k += 1
    return k


def test_the_first_chunk_forecasts_the_window_and_a_wrong_forecast_costs_a_pass_not_bits() -> None:
    # float32 variances: a first chunk like the rest lets the first pass count the window's end exactly (then the
    # energy pass); a first chunk without any variance forecasts an empty window, and the second pass counts it.
    tensors = inputs(torch.float32, (64, 2048), seed=8)
    assert statistics_passes(tensors, {"select_topk": 0.3}, rows=16) == 2
    quiet_start = [tensors[0], *(torch.cat([tensors[0][:16], t[16:]]) for t in tensors[1:])]
    assert statistics_passes(quiet_start, {"select_topk": 0.3}, rows=16) == 3
    assert_streams_like_whole(quiet_start, {"select_topk": 0.3})
    # No window: the energy pass alone.
    assert statistics_passes(tensors, {}, rows=16) == 1

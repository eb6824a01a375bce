"""DARE and DELLA over row chunks: bit-identical to the whole-tensor path for every chunking, generator included."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from methods.test_task_stream import bits, cuts
from resumerge.merge.methods import MergeContext, get_method, sample_stream

SAMPLED = ["dare_ties", "dare_linear", "della", "della_linear"]
SEED = 1234


def context(tensors: Sequence[torch.Tensor], base: int, model_params: Sequence[Mapping[str, Any]],
            params: Mapping[str, Any]) -> MergeContext:
    # As the engine builds each chunk's context: a generator freshly seeded for the tensor.
    return MergeContext(list(tensors), base, model_params, params, torch.Generator().manual_seed(SEED))


def whole(method: str, tensors: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]],
          params: Mapping[str, Any]) -> torch.Tensor:
    spec = get_method(method)
    assert spec is not None
    return spec.fn(context([t.clone() for t in tensors], 0, *spec.bind(model_params, params, 0)))


def streamed(method: str, tensors: Sequence[torch.Tensor], model_params: Sequence[Mapping[str, Any]],
             params: Mapping[str, Any], observe_sizes: Sequence[int], apply_sizes: Sequence[int]) -> torch.Tensor:
    spec = get_method(method)
    assert spec is not None and spec.streamed is not None
    model_params, params = spec.bind(model_params, params, 0)  # as the planner resolves them
    stream = spec.streamed(tuple(tensors[0].shape), 0, model_params, params)
    assert stream is not None
    rows = tensors[0].shape[0]
    k = 0
    while stream.wants(k):
        for a, b in cuts(rows, observe_sizes):
            stream.observe(k, context([t[a:b].clone() for t in tensors], 0, model_params, params))
        k += 1
    return torch.cat([stream.apply(context([t[a:b].clone() for t in tensors], 0, model_params, params))
                      for a, b in cuts(rows, apply_sizes)])


def inputs(dtype: torch.dtype, shape: tuple[int, ...], seed: int, models: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    return [t.to(dtype) for t in [base, *(base + 0.1 * torch.randn(shape, generator=g) for _ in range(models))]]


CHUNKINGS = [([1], [1]), ([3, 1, 2], [5]), ([1000], [1000]), ([7], [2, 9])]


@pytest.mark.parametrize("method", SAMPLED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_chunks_give_the_whole_tensors_bits(method: str, dtype: torch.dtype) -> None:
    tensors = inputs(dtype, (23, 37), seed=len(method))
    model_params = [{}, {"weight": 0.6, "density": 0.4, "epsilon": 0.1}, {"weight": 0.5, "density": 0.7}]
    expected = whole(method, tensors, model_params, {})
    for observe_sizes, apply_sizes in CHUNKINGS:
        got = streamed(method, tensors, model_params, {}, observe_sizes, apply_sizes)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(bits(got), bits(expected)), (method, dtype, observe_sizes, apply_sizes)


@pytest.mark.parametrize("method", SAMPLED)
@pytest.mark.parametrize("params", [{"rescale": False}, {"rescale": True, "normalize": True, "lambda": 0.7}])
def test_switches_and_degenerate_densities(method: str, params: dict[str, Any]) -> None:
    # A density of 1 draws nothing, DELLA's 0 zeros without drawing, DARE's 0 still draws: the models after them
    # must see the generator exactly where the whole-tensor path leaves it. Three models, 3-D rows too.
    for shape in [(9, 4, 6), (40, 33)]:
        tensors = inputs(torch.float32, shape, seed=7, models=4)
        model_params = [{}, {"weight": 1.0, "density": 1.0}, {"weight": 0.3, "density": 0.0},
                        {"weight": 0.4, "density": 0.3, "epsilon": 0.2}, {"weight": 0.2, "density": 0.8}]
        expected = whole(method, tensors, model_params, params)
        for observe_sizes, apply_sizes in CHUNKINGS:
            got = streamed(method, tensors, model_params, params, observe_sizes, apply_sizes)
            assert torch.equal(bits(got), bits(expected)), (method, params, shape, observe_sizes)


def test_a_chunk_drawn_from_a_shared_generator_would_differ() -> None:
    # The test above can fail: interleaving the task vectors' draws chunk by chunk from one generator (the
    # obvious streaming) gives other masks than drawing each task vector whole in turn.
    tensors = inputs(torch.float32, (16, 16), seed=3)
    model_params = [{}, {"weight": 0.5, "density": 0.5}, {"weight": 0.5, "density": 0.5}]
    expected = whole("dare_linear", tensors, model_params, {})
    spec = get_method("dare_linear")
    assert spec is not None
    shared = torch.Generator().manual_seed(SEED)
    parts = [spec.fn(MergeContext([t[a:a + 4].clone() for t in tensors], 0, *spec.bind(model_params, {}, 0), shared))
             for a in range(0, 16, 4)]
    assert not torch.equal(torch.cat(parts), expected)


def test_della_leaves_one_dimensional_tensors_whole() -> None:
    spec = get_method("della")
    assert spec is not None and spec.streamed is not None
    assert spec.streamed((64,), 0, *spec.bind([{}, {"weight": 1.0, "density": 0.5}], {}, 0)) is None
    dare = get_method("dare_ties")
    assert dare is not None and dare.streamed is not None
    per_model = [{}, {"weight": 1.0, "density": 0.5}, {"weight": 1.0, "density": 1.0}]
    stream = dare.streamed((64,), 0, *dare.bind(per_model, {}, 0))
    assert stream is not None and stream.held_bytes() == 64  # one mask byte per entry, for the sampled model only


@pytest.mark.parametrize("words", [0, 1, 2, 7, 2 * 65536 + 3, 3 * 65536])
def test_skipping_words_leaves_the_generator_where_drawing_them_does(words: int) -> None:
    # Pins the installed torch's float64 uniform_ to two 32-bit words an entry (the skip's fast path).
    drawn, skipped = torch.Generator().manual_seed(SEED), torch.Generator().manual_seed(SEED)
    torch.empty(words).uniform_(generator=drawn)
    sample_stream._skip_words(skipped, words)
    assert torch.equal(torch.empty(9).uniform_(generator=drawn), torch.empty(9).uniform_(generator=skipped))


@pytest.mark.parametrize("method", SAMPLED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_whole_tensors_computed_in_the_lent_buffer_keep_their_bytes(method: str, dtype: torch.dtype) -> None:
    # With a buffer lent by the engine (reused, holding an earlier tensor's values) the task vectors and the result
    # are computed in it, the result first: the same bytes as in fresh memory.
    spec = get_method(method)
    assert spec is not None
    tensors = inputs(dtype, (40, 33), seed=3, models=3)
    model_params = [{}] + [{"weight": 0.4, "density": 0.5, "epsilon": 0.2}] * 3
    expected = whole(method, tensors, model_params, {})
    held = torch.full((5 * 40 * 33 + 7,), -3.5, dtype=dtype)
    asked: list[tuple[int, ...]] = []

    def lend(use: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        asked.append(shape)
        return held[: torch.Size(shape).numel()].view(shape)

    ctx = context(tensors, 0, *spec.bind(model_params, {}, 0))
    out = spec.fn(MergeContext(ctx.tensors, 0, ctx.model_params, ctx.params, ctx.generator, lend=lend))
    assert torch.equal(bits(out), bits(expected)) and out.data_ptr() == held.data_ptr()
    assert asked == [(4, 40 * 33)]

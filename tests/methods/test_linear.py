"""``linear`` and ``passthrough``: hand-computed values and properties."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

Merge = Callable[..., torch.Tensor]

A = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
B = torch.tensor([[3.0, 2.0, 1.0], [0.0, -1.0, 2.0]])


def test_linear_normalized_weighted_average(merge: Merge) -> None:
    out = merge("linear", [A, B], per_model={"weight": [1.0, 3.0]})
    # (A + 3B) / 4
    assert torch.equal(out, torch.tensor([[2.5, 2.0, 1.5], [1.0, 0.5, 3.0]]))


def test_linear_without_normalize_is_the_weighted_sum(merge: Merge) -> None:
    out = merge("linear", [A, B], params={"normalize": False}, per_model={"weight": [1.0, 3.0]})
    assert torch.equal(out, torch.tensor([[10.0, 8.0, 6.0], [4.0, 2.0, 12.0]]))


def test_linear_accumulates_half_precision_in_float32(merge: Merge) -> None:
    # fp16 steps of 1 near 1024: adding 0.375 twice in fp16 stays at 1024; in float32 it reaches 1024.75 → 1025.
    big = torch.full((3,), 1024.0, dtype=torch.float16)
    small = torch.full((3,), 0.375, dtype=torch.float16)
    out = merge("linear", [big, small, small], params={"normalize": False}, per_model={"weight": [1.0] * 3})
    assert out.dtype == torch.float16
    assert torch.equal(out, torch.full((3,), 1025.0, dtype=torch.float16))


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 5), cols=st.integers(1, 7))
def test_linear_with_weights_one_zero_returns_the_first(merge: Merge, seed: int, rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(2, rows, cols, generator=gen)
    out = merge("linear", [a, b], per_model={"weight": [1.0, 0.0]})
    assert torch.equal(out, a)
    assert out.data_ptr() != a.data_ptr()


def test_passthrough_copies_without_aliasing(merge: Merge) -> None:
    out = merge("passthrough", [A])
    assert torch.equal(out, A)
    assert out.data_ptr() != A.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passthrough_scales(merge: Merge, dtype: torch.dtype) -> None:
    out = merge("passthrough", [A.to(dtype)], per_model={"scale": [0.5]})
    assert out.dtype == dtype
    assert torch.equal(out, (A * 0.5).to(dtype))


def _whole(tensors: list[torch.Tensor], weights: list[float], normalize: bool) -> torch.Tensor:
    """linear as one pass of each operation over the whole tensor (the sum before tiles)."""
    acc_dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    w = torch.tensor(weights, dtype=acc_dtype)
    acc = torch.zeros(tensors[0].shape, dtype=acc_dtype)
    for t, weight in zip(tensors, w.unbind(0)):
        acc.addcmul_(t, weight)
    if normalize:
        acc.div_(w.sum())
    return acc.to(tensors[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_summed_tile_by_tile_has_the_bits_of_whole_tensor_passes(merge: Merge, dtype: torch.dtype,
                                                                        normalize: bool, threads: int) -> None:
    # Three tiles and a ragged end (an odd row length): every element, the vector loop's tail included, is computed
    # as one pass over the whole tensor computes it (tiles on one thread; split over two, the sum runs whole).
    from resumerge.merge.methods.linear import TILE

    gen = torch.Generator().manual_seed(7)
    shape = (3 * TILE // 999 + 5, 999)
    tensors = [torch.randn(shape, generator=gen).mul_(100.0 ** i).to(dtype) for i in range(3)]
    tensors[1][0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 0.5, -0.5]).to(dtype)
    weights = [0.3, 0.7, -0.25]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = merge("linear", tensors, params={"normalize": normalize}, per_model={"weight": weights})
        expected = _whole(tensors, weights, normalize)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == dtype and out.shape == shape
    assert torch.equal(out.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))


def test_linear_sums_broadcast_and_strided_inputs_whole(merge: Merge) -> None:
    from resumerge.merge.methods.linear import TILE

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(4, TILE, generator=gen)
    b = torch.randn(TILE, 4, generator=gen).t()  # not contiguous: summed whole, as before tiles
    out = merge("linear", [a, b], per_model={"weight": [1.0, 3.0]})
    assert torch.equal(out, _whole([a, b.contiguous()], [1.0, 3.0], True))

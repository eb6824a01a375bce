"""Selection-based ranking: exact against stable sorts, deterministic across threads, devices' code paths agree."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumerge.merge.methods import get_method, ranking, sparsify
from resumerge.merge.methods.rankstream import StreamedWindow
from resumerge.merge.methods.sce_steps import variance_mask

RANK_BASED = ["ties", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce"]


def reference_window(keys: torch.Tensor, start: int, stop: int, *, descending: bool) -> torch.Tensor:
    """The positions [start, stop) of a stable sort, the definition the rank window must meet."""
    order = torch.sort(keys.reshape(-1), descending=descending, stable=True).indices
    mask = torch.zeros(keys.numel(), dtype=torch.bool)
    mask[order[max(0, start) : max(0, stop)]] = True
    return mask.reshape(keys.shape)


def whole_window(keys: torch.Tensor, start: int, stop: int, *, descending: bool,
                 dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The rank window over the keys as one chunk."""
    window = StreamedWindow(keys.numel(), start, stop, descending=descending, whole=True)
    return window.mask(keys, dtype)


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_magnitude_keys_order_and_tie_exactly_as_the_values(dtype: torch.dtype) -> None:
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-40, 3.0, 3.0, 2.5], dtype=torch.float64)
    values = torch.cat([special, torch.randn(500, generator=torch.Generator().manual_seed(0)).double()])
    values = values.to(dtype).abs()  # magnitudes, as the contract asks (abs also clears a NaN's sign bit)
    keys = ranking.magnitude_keys(values)
    assert keys.dtype == (torch.int64 if dtype == torch.float64 else torch.int32)
    by_value = torch.sort(values, stable=True).indices
    assert torch.equal(torch.sort(keys, stable=True).indices, by_value)


def test_magnitude_keys_reject_integers() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        ranking.magnitude_keys(torch.arange(4))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16])
def test_order_statistics_equal_sorted_values_on_both_code_paths(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    values = (torch.randn(1001, generator=gen) * 50).round().to(dtype)  # many equal values
    if dtype.is_floating_point:
        values[7] = float("nan")  # sorts last in both
    positions = [0, 500, 250, 999, 1000, 500]
    expected = torch.sort(values).values[positions]
    for select in (ranking.order_statistics, ranking._select_numpy, ranking._select_torch):
        got = select(values, positions)
        assert got.dtype == dtype
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_int32_selection_by_counting_equals_a_sort_across_chunks_signs_and_extremes() -> None:
    # What a GPU selects int32 keys by (two 2^16-bucket histograms, counted over chunks of 2^20 keys); the CPU
    # selects with numpy, so the function is called here directly.
    gen = torch.Generator().manual_seed(3)
    full = torch.randint(-2**31, 2**31 - 1, ((1 << 20) + 3,), generator=gen, dtype=torch.int64).to(torch.int32)
    extremes = torch.full((999,), -2**31, dtype=torch.int32)
    extremes[::3] = 2**31 - 1
    one_bucket = torch.randint(0, 1 << 16, (5000,), generator=gen, dtype=torch.int32) + (7 << 16)  # same upper half
    cases = [full, extremes, one_bucket, torch.randint(-3, 3, (4097,), generator=gen, dtype=torch.int32),
             ranking.magnitude_keys(torch.randn(3001, generator=gen).abs()), torch.tensor([-5], dtype=torch.int32)]
    for values in cases:
        n = values.numel()
        positions = [0, n - 1, n // 2, n // 3, n // 2]
        got = ranking._select_counted(values, positions)
        assert got.dtype == torch.int32 and torch.equal(got, torch.sort(values).values[positions])


def test_order_statistics_rejects_positions_outside_the_tensor() -> None:
    with pytest.raises(IndexError):
        ranking.order_statistics(torch.arange(5, dtype=torch.int32), [5])
    assert ranking.order_statistics(torch.arange(5, dtype=torch.int32), []).numel() == 0


@settings(deadline=None, max_examples=200)
@given(
    values=st.lists(st.integers(0, 6), min_size=1, max_size=60),
    start=st.integers(-2, 62),
    length=st.integers(0, 62),
    descending=st.booleans(),
    dtype=st.sampled_from([torch.bool, torch.float32, torch.bfloat16]),
    wide=st.booleans(),
)
def test_the_window_over_one_chunk_is_the_window_of_a_stable_sort(
    values: list[int], start: int, length: int, descending: bool, dtype: torch.dtype, wide: bool
) -> None:
    keys = torch.tensor(values, dtype=torch.int64 if wide else torch.int32)
    expected = reference_window(keys, start, start + length, descending=descending)
    got = whole_window(keys, start, start + length, descending=descending, dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype))


def test_the_window_over_one_chunk_keeps_the_tie_rule_on_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Off the CPU the selection runs in torch; route the CPU there too and compare with the stable sort.
    monkeypatch.setattr(ranking, "_select_numpy", ranking._select_torch)
    keys = torch.randint(0, 9, (40, 33), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    for start, stop, descending in [(0, 500, True), (300, 1100, False), (17, 18, False), (1319, 1320, True),
                                    (1000, 1320, False), (0, 1319, False)]:
        expected = reference_window(keys, start, stop, descending=descending)
        for dtype in (torch.bool, torch.float32):
            got = whole_window(keys, start, stop, descending=descending, dtype=dtype)
            assert torch.equal(got, expected.to(dtype))


def test_the_window_over_one_chunk_takes_all_its_keys_at_once() -> None:
    window = StreamedWindow(10, 2, 5, descending=True, whole=True)
    assert not window.wants(0)  # no statistics pass
    with pytest.raises(ValueError, match="one chunk"):
        window.mask(torch.arange(4, dtype=torch.int32), torch.bool)
    with pytest.raises(ValueError, match="never deferred"):
        StreamedWindow(10, 2, 5, descending=True, whole=True, deferred=True)


@settings(deadline=None, max_examples=60)
@given(rows=st.integers(1, 5), cols=st.integers(1, 40), top=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_stable_order_equals_a_stable_argsort(rows: int, cols: int, top: int, seed: int) -> None:
    keys = torch.randint(0, top + 1, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    assert torch.equal(ranking.stable_order(keys), torch.sort(keys, dim=1, stable=True).indices)
    wide = keys.long() << 40  # int64 keys take the torch.sort(stable=True) path
    assert torch.equal(ranking.stable_order(wide), torch.sort(wide, dim=1, stable=True).indices)


@pytest.mark.parametrize("cols", [1, 3, 1000, 1 << 16, (1 << 16) + 1], ids=str)
def test_stable_order_of_bfloat16_keys_packs_them_narrow_with_the_same_order(
    cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bfloat16 magnitudes widened to float32: keys with 16 zero low bits, from 0 to NaN's, many equal in each row.
    g = torch.Generator().manual_seed(cols)
    values = (torch.randn(2, cols, generator=g) * 4).round().to(torch.bfloat16).abs()
    values[0, ::5] = 0
    values[1, :: max(1, cols // 3)] = float("nan")
    keys = ranking.magnitude_keys(values)
    sorted_dtypes: list[torch.dtype] = []
    real = ranking._sort_rows

    def recording(packed: torch.Tensor, *, as_doubles: bool = False) -> torch.Tensor:
        sorted_dtypes.append(torch.float64 if as_doubles else packed.dtype)
        return real(packed, as_doubles=as_doubles)

    monkeypatch.setattr(ranking, "_sort_rows", recording)
    order = ranking.stable_order(keys, ranking.exact_key_shift(torch.bfloat16))
    stable = torch.from_numpy(np.argsort(keys.numpy(), axis=1, kind="stable"))  # faster than torch's here
    assert torch.equal(order, stable) and order.dtype == torch.int64
    # Up to 2¹⁶ columns the 15 bits left of a key and the column's fit an int32; past it they sort as doubles.
    assert sorted_dtypes == [torch.int32 if cols <= 1 << 16 else torch.float64]
    assert torch.equal(ranking.stable_order(keys), order)  # no shift: the int64 packing, the same order


@pytest.mark.parametrize("cols", [1, 2, 37, 1 << 20, (1 << 20) + 1], ids=str)
def test_stable_order_of_any_int32_keys_sorted_as_doubles_is_the_stable_order(
    cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Negative keys, the extremes and repeats: moved to 0 … 2³² − 1 and packed with the column, every row sorts as
    # positive normal doubles up to 2²⁰ columns, past it as int64.
    g = torch.Generator().manual_seed(cols)
    keys = torch.randint(-(1 << 31), 1 << 31, (3, cols), generator=g, dtype=torch.int64).to(torch.int32)
    keys[0, ::3] = 7
    keys[1, ::2] = -(1 << 31)
    keys[2, 1::2] = (1 << 31) - 1
    doubles: list[bool] = []
    real = ranking._sort_rows

    def recording(packed: torch.Tensor, *, as_doubles: bool = False) -> torch.Tensor:
        doubles.append(as_doubles)
        return real(packed, as_doubles=as_doubles)

    monkeypatch.setattr(ranking, "_sort_rows", recording)
    stable = torch.from_numpy(np.argsort(keys.numpy(), axis=1, kind="stable"))
    assert torch.equal(ranking.stable_order(keys), stable)
    assert doubles == [cols <= 1 << 20]


def test_stable_order_needs_rows() -> None:
    with pytest.raises(ValueError, match="2-D"):
        ranking.stable_order(torch.zeros(3, dtype=torch.int32))
    assert ranking.stable_order(torch.zeros(0, 4, dtype=torch.int32)).shape == (0, 4)


def test_ties_at_the_threshold_go_to_the_lowest_indices() -> None:
    delta = torch.tensor([1.0, -2.0, 2.0, 2.0, 0.5, -2.0])
    # TIES keeps k = 2 of four equal magnitudes 2: indices 1 and 2
    assert torch.equal(sparsify.magnitude(delta, 2 / 6, rescale=False), torch.tensor([0, -2.0, 2, 0, 0, 0]))
    # breadcrumbs keeps ascending positions [2, 5) (skipping 6 − 3 − 1 smallest): the first three of the four 2s;
    # the last (index 5) is the dropped outlier
    out = sparsify.magnitude_outliers(delta, 0.5, 1 / 6, rescale=False)
    assert torch.equal(out, torch.tensor([0, -2.0, 2, 2, 0, 0]))


def test_della_ranks_equal_magnitudes_by_index() -> None:
    # Four equal magnitudes in one row get ranks 1..4 in index order, so keep probabilities rise left to right.
    row = torch.full((20_000, 4), 3.0)
    kept = (sparsify.sample(row, sparsify.Sampled(0.5, 0.4), rescale=False, generator=torch.Generator()) != 0).double()
    rates = kept.mean(dim=0)
    assert torch.allclose(rates, torch.tensor([0.1, 0.1 + 0.8 / 3, 0.9 - 0.8 / 3, 0.9]).double(), atol=0.015)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masks_are_the_same_for_any_thread_count(threads: None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    deltas = (0.01 * torch.randn(3, 300, 257, generator=gen)).to(dtype)  # above torch's parallel grain
    results = []
    for count in (1, 2):
        torch.set_num_threads(count)
        results.append(
            [
                sparsify.magnitude(deltas[0], 0.3, rescale=False),
                sparsify.magnitude_outliers(deltas[1], 0.4, 0.05, rescale=False),
                sparsify.sample(deltas[2], sparsify.Sampled(0.4, 0.2), rescale=False,
                                generator=torch.Generator().manual_seed(9)),
                variance_mask(deltas, 0.3, torch.int8),
            ]
        )
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_rank_based_methods_take_whole_tensors() -> None:
    # A threshold is per tensor, as the methods define it; the engine must never hand them row chunks.
    for name in RANK_BASED:
        spec = get_method(name)
        assert spec is not None and not spec.elementwise, name


@pytest.mark.parametrize(("cols", "shift"), [(1000, None), (1000, 16), (37, None)], ids=str)
def test_stable_order_built_in_a_given_buffer_is_the_same_order(cols: int, shift: int | None) -> None:
    # A buffer reused block after block (larger than the block, holding an earlier block's order) changes nothing:
    # the order is built in its first entries, on the doubles' path, the int64 one and bfloat16's narrow one.
    g = torch.Generator().manual_seed(cols)
    values = (torch.randn(4, cols, generator=g) * 4).round().abs()
    if shift is not None:
        values = values.to(torch.bfloat16)
    keys = ranking.magnitude_keys(values)
    buffer = torch.full((5 * cols,), -1, dtype=torch.int64)
    order = ranking.stable_order(keys, shift, out=buffer)
    assert order.data_ptr() == buffer.data_ptr()
    assert torch.equal(order, ranking.stable_order(keys, shift))
    assert torch.equal(ranking.stable_order(keys.flip(1), shift, out=buffer), ranking.stable_order(keys.flip(1), shift))
    wide = keys.long() << 40  # int64 keys: torch.sort's stable path, the buffer unused
    assert torch.equal(ranking.stable_order(wide, out=buffer), torch.sort(wide, dim=1, stable=True).indices)

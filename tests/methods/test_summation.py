"""The ordered sum: torch's single-thread bits, the same bits from any pieces, and from any thread count."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from support import one_thread as torch_on_one_thread

from resumerge.merge.methods.consensus import sign_consensus_weights
from resumerge.merge.methods.summation import OrderedSum, ordered_sum, row_sum

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# Around every boundary of the order: lanes, vectors, rows of four vectors, level steps, torch's parallel grain.
SIZES = [0, 1, 3, 5, 7, 8, 12, 15, 16, 17, 31, 33, 64, 511, 513, 4095, 8193, 32768, 40001, 262147, 1_048_583]


@pytest.fixture
def one_thread() -> Iterator[None]:
    with torch_on_one_thread():
        yield


def sample(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(dtype)


def bits(t: torch.Tensor) -> int:
    return int(t.reshape(1).view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]).item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_sums_in_this_order_on_one_thread(dtype: torch.dtype, one_thread: None) -> None:
    # What keeps rescaled DARE/DELLA/TIES results on mergekit's bits (on one thread of the installed torch).
    for n in SIZES:
        values = sample(n, dtype, seed=n)
        assert bits(ordered_sum(values)) == bits(values.sum()), (dtype, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pieces_of_any_size_give_the_same_bits(dtype: torch.dtype) -> None:
    for n in SIZES[1:]:
        values = sample(n, dtype, seed=2 * n + 1)
        expected = bits(ordered_sum(values))
        rng = random.Random(n)
        for _ in range(3):
            summer = OrderedSum(n, dtype)
            position = 0
            while position < n:
                size = rng.choice([1, 2, 31, 64, 100, 4096, 70000])
                summer.add(values[position : position + size])
                position += size
            assert bits(summer.result()) == expected, (dtype, n)
        # Its waiting numbers kept in a buffer of the caller's (larger, holding another sum's leftovers) instead.
        asked: list[int] = []
        waiting = OrderedSum.buffer_bytes(n, dtype.itemsize) // dtype.itemsize

        def lend(count: int, asked: list[int] = asked, waiting: int = waiting) -> torch.Tensor:
            asked.append(count)
            return torch.full((waiting + 3,), 7, dtype=dtype)

        lent = OrderedSum(n, dtype, lend=lend)
        for position in range(0, n, 70001):
            lent.add(values[position : position + 70001])
        assert bits(lent.result()) == expected, (dtype, n)
        assert len(asked) <= 1 and all(count <= waiting for count in asked)


_CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from resumerge.merge.methods.summation import ordered_sum
g = torch.Generator().manual_seed(5)
values = torch.rand(11_000_001, generator=g)
print(values.sum().view(torch.int32).item(), ordered_sum(values).view(torch.int32).item())
"""


def test_thread_count_changes_torch_but_not_the_ordered_sum() -> None:
    # The reason for the ordered sum: torch splits a long sum over the threads a process starts with. If this
    # machine's torch ever stops splitting, the first assertion says so (the rest then proves nothing).
    runs = {threads: subprocess.run([sys.executable, "-c", _CHILD, str(threads)], capture_output=True, text=True,
                                    check=True).stdout.split() for threads in (1, 2)}
    (serial_torch, serial_ours), (parallel_torch, parallel_ours) = runs[1], runs[2]
    assert serial_torch != parallel_torch
    assert serial_ours == parallel_ours == serial_torch


def test_misuse_is_refused() -> None:
    summer = OrderedSum(4, torch.float32)
    with pytest.raises(ValueError, match="fed"):
        summer.add(torch.ones(2, dtype=torch.float64))
    summer.add(torch.ones(3))
    with pytest.raises(ValueError, match="read after 3"):
        summer.result()
    with pytest.raises(ValueError, match="fed 5"):
        summer.add(torch.ones(2))
    with pytest.raises(ValueError, match="no ordered sum"):
        OrderedSum(1, torch.int32)


# Two pools of special values: the finite ones (signed zeros, subnormals of every dtype, exact cancellations)
# leave the sum finite, so row_sum's own path runs; the others (infinities, NaN, overflowing pairs) make it take
# torch's sum, which must be seen to happen too.
FINITE = [0.0, -0.0, 1e-40, -1e-40, 1e-45, -1e-45, 2.0**-133, -(2.0**-133), 6e-8, -6e-8, 3.0, -3.0, 1e4, -1e4]
NOT_FINITE = [float("inf"), -float("inf"), float("nan"), 65504.0, -65504.0, 3.4e38, -3.4e38]


def two_rows(dtype: torch.dtype, seed: int, *, specials: bool) -> torch.Tensor:
    """Two rows of task-vector-like values: spread magnitudes, near-cancelling pairs, and (``specials``) a third
    of the entries special values (NaN, infinities and overflowing pairs too for odd seeds)."""
    g = torch.Generator().manual_seed(seed)
    n = 9_000 + seed
    rows = torch.randn(2, n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(2, n, generator=g, dtype=torch.float64) * (seed % 5)).clamp(-1e4, 1e4)  # finite in float16
    rows[1, ::3] = -rows[0, ::3] * (1 + torch.randn(len(range(0, n, 3)), generator=g, dtype=torch.float64) * 1e-3)
    if specials:
        pool = torch.tensor(FINITE + (NOT_FINITE if seed % 2 else []), dtype=torch.float64)
        picked = pool[torch.randint(0, len(pool), (2, n), generator=g)]
        rows = torch.where(torch.rand(2, n, generator=g) < 0.3, picked, rows)
        rows[:, :2] = -0.0  # both rows' -0 at one position at least: torch's sum gives +0 there
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_row_sum_has_the_bits_of_torchs_sum_over_two_rows(dtype: torch.dtype, threads: int) -> None:
    # What lets TIES' combine add two models' rows without torch's outer reduction: the same bits, signed zeros
    # and NaN included; other counts of rows are torch's own sum.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for seed in range(8):
            rows = two_rows(dtype, seed, specials=seed % 3 != 0)
            # Even seeds take row_sum's own path (no NaN in the sum); odd seeds with specials its fallback.
            assert bool(rows.sum(dim=0).sum().isnan()) == (seed % 2 == 1 and seed % 3 != 0), seed
            assert torch.equal(bits_of(row_sum(rows)), bits_of(rows.sum(dim=0))), seed
            # A block of the combine: a column slice of the stacked task vectors.
            block = rows[:, 1000:8192]
            assert torch.equal(bits_of(row_sum(block)), bits_of(block.sum(dim=0))), seed
            weights = torch.tensor([0.7, -0.3], dtype=dtype).reshape(2, 1)
            weighted = rows * weights
            mask = sign_consensus_weights(weighted)
            expected = torch.mul(weighted, torch.where(weighted.sum(dim=0) >= 0, 1.0, -1.0).to(dtype)).gt_(0)
            assert torch.equal(mask, expected.to(dtype)), seed
        three = two_rows(dtype, 1, specials=True)[:, :999].repeat(3, 1)[:3]
        assert torch.equal(bits_of(row_sum(three)), bits_of(three.sum(dim=0)))
    finally:
        torch.set_num_threads(before)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])

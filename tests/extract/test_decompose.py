"""The decomposition math on hand-made matrices: exact truncation, the randomized one's error bound against it,
determinism for a seed, mergekit's scale distribution, and --sv-epsilon's rank rule."""

from __future__ import annotations

import pytest
import torch

from resumerge.runs.extract.decompose import (
    changed_lines,
    exact_svd,
    factors,
    keep_unchanged,
    kept_rank,
    randomized_svd,
    sketch_width,
)


def _low_rank_plus_noise(m: int, n: int, rank: int, noise: float, seed: int) -> torch.Tensor:
    """A task vector of real shape: a decaying rank-``rank`` part plus Gaussian noise ``noise`` times its scale."""
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor([0.93**i for i in range(rank)])
    low = (torch.randn(m, rank, generator=g) * s) @ torch.randn(rank, n, generator=g)
    return low + noise * low.std() * torch.randn(m, n, generator=g)


def _error(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(x - b @ a))


def test_exact_reconstructs_a_low_rank_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, generator=g) @ torch.randn(3, 30, generator=g)
    a, b = factors(exact_svd(x, 3), 3, distribute_scale=True)
    assert a.shape == (3, 30) and b.shape == (20, 3)
    assert torch.allclose(b @ a, x, atol=1e-5)


@pytest.mark.parametrize(("shape", "rank", "noise"), [
    ((256, 704), 32, 0.3),   # an MLP projection's aspect, noise-dominated tail (the range finder's hard case)
    ((704, 256), 16, 1.0),   # tall, noise as large as the signal
    ((384, 384), 32, 0.05),  # square, signal-dominated
])
def test_randomized_within_half_a_percent_of_exact(shape: tuple[int, int], rank: int, noise: float) -> None:
    x = _low_rank_plus_noise(*shape, rank=64, noise=noise, seed=1)
    assert 2 * sketch_width(rank, *shape) < min(shape)  # the randomized path runs, not the exact fallback
    exact = _error(x, *factors(exact_svd(x, rank), rank, True))
    fast = _error(x, *factors(randomized_svd(x, rank, seed=5), rank, True))
    assert 0.99999 * exact <= fast <= 1.005 * exact  # (float32 rounding may put it a hair below)


def test_randomized_is_deterministic_for_a_seed() -> None:
    x = _low_rank_plus_noise(300, 200, rank=40, noise=0.2, seed=2)
    first, again, other = (randomized_svd(x, 20, seed=s) for s in (3, 3, 4))
    assert torch.equal(first.u, again.u) and torch.equal(first.s, again.s) and torch.equal(first.vh, again.vh)
    assert not torch.equal(first.vh, other.vh)


def test_scale_distribution_like_mergekit() -> None:
    x = _low_rank_plus_noise(40, 24, rank=8, noise=0.0, seed=3)
    t = exact_svd(x, 5)
    a, b = factors(t, 5, distribute_scale=True)
    assert torch.allclose(a.norm(dim=1), t.s.sqrt(), rtol=1e-5)  # √s on each side
    assert torch.allclose(b.norm(dim=0), t.s.sqrt(), rtol=1e-5)
    a2, b2 = factors(t, 5, distribute_scale=False)
    assert torch.allclose(a2.norm(dim=1), t.s, rtol=1e-5)  # s on A, B = U
    assert torch.allclose(b2.norm(dim=0), torch.ones(5), rtol=1e-5)
    assert torch.allclose(b @ a, b2 @ a2, atol=1e-5)


def test_epsilon_keeps_values_above_it() -> None:
    s = torch.tensor([5.0, 2.0, 0.5, 0.1])
    assert kept_rank(s, 3, 0.0) == 3
    assert kept_rank(s, 3, 1.0) == 2
    assert kept_rank(s, 4, 0.1) == 3  # strictly above
    assert kept_rank(s, 4, 9.0) == 0


@pytest.mark.parametrize("shape", [(40, 300), (300, 40), (256, 704)])
def test_rows_and_columns_the_fine_tune_left_unchanged_stay_exactly_zero(shape: tuple[int, int]) -> None:
    # a pad token's embedding row, an input the fine-tune never moved: float32's truncation leaves ~1e-8 there
    x = _low_rank_plus_noise(*shape, rank=64, noise=0.3, seed=3)
    x[5] = 0
    x[:, 7] = 0
    x[-1] = 0
    rows, columns = changed_lines(x)
    assert rows.sum() == shape[0] - 2 and columns.sum() == shape[1] - 1
    for t in (exact_svd(x, 8), randomized_svd(x, 8, seed=0)):
        a, b = factors(t, 8, True)
        before = b @ a
        assert before[5].any() or before[:, 7].any()  # what float32 leaves
        keep_unchanged(a, b, rows, columns)
        product = b @ a
        assert not product[5].any() and not product[-1].any() and not product[:, 7].any()
        assert torch.equal(product[rows][:, columns], before[rows][:, columns])  # the rest untouched

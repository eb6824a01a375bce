"""The approximations that solve least squares give the same bits call after call (a resumed run computes the
batches a killed one had not finished, and its output must be byte for byte the uninterrupted run's), and the
solver they share computes lstsq's definition: the minimum-norm solution, rank-deficient systems included.

``torch.linalg.lstsq``'s default CPU driver (gelsy) failed this: its pivot array is read uninitialized from the heap
(pytorch/pytorch#187411), so what ran before a call changed its answer's low bits, on one thread as on two."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support import torch_threads

from resumerge.runs.transplant.approximate import Method, Rope, interpolation, mp_rope, token_basis
from resumerge.runs.transplant.leastsq import least_squares, pseudo_inverse_solve

DONOR_WIDTH, MODEL_WIDTH, SHARED, BATCH = 48, 64, 200, 32


def _tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return (torch.randn(BATCH, DONOR_WIDTH, generator=g), torch.randn(SHARED, DONOR_WIDTH, generator=g),
            torch.randn(SHARED, MODEL_WIDTH, generator=g))


def _weights(scheme: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda t, a, b: interpolation(t, a, Method("common_interpolation", k=8, weight_scheme=scheme))[1]


# Each method that solves least squares, on one batch as a unit computes it (float32, k atoms or neighbours).
METHODS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mp_rope": lambda t, a, b: mp_rope(t, a, b, 8, (Rope(4, 10000.0), Rope(4, 500000.0))),
    "stb": lambda t, a, b: token_basis(t, a, b, 8),
    "least_squares": _weights("least_squares"),
    "barycentric": _weights("barycentric"),
}


def _litter(round_: int) -> None:
    """Leave the heap as other work does between two batches: small integer buffers written and freed (an index
    tensor, a previous solve's pivots)."""
    for size in range(1, 80):
        torch.full((size,), round_ + size, dtype=torch.int32).add_(1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(METHODS))
def test_the_same_batch_gives_the_same_bits_call_after_call(name: str, threads: int) -> None:
    tables = _tables()
    with torch_threads(threads):
        first = METHODS[name](*tables)
        for round_ in range(20):
            _litter(round_)
            again = METHODS[name](*tables)
            assert torch.equal(again.view(torch.uint8), first.view(torch.uint8)), (name, threads, round_)


SOLVERS = [least_squares, pseudo_inverse_solve]


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_full_rank_system_gets_its_least_squares_solution(solve: Callable[..., torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(5, 40, 8, generator=g), torch.randn(5, 40, 3, generator=g)
    wide_a, wide_b = a.double(), b.double()
    normal = torch.linalg.solve(wide_a.mT @ wide_a, wide_a.mT @ wide_b)  # the normal equations, in float64
    torch.testing.assert_close(solve(a, b).double(), normal, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_rank_deficient_system_gets_the_least_norm_solution(solve: Callable[..., torch.Tensor]) -> None:
    """Two equal neighbours share the weight one of them would get; a zero row and column leave that unknown at
    zero (pytorch/pytorch#92537: gelsy answered rank 0 about half the time); a wide system takes the least-norm
    of its exact solutions; nothing at all gives zeros."""
    g = torch.Generator().manual_seed(13)
    column = torch.randn(16, 1, generator=g)
    others = torch.randn(16, 2, generator=g)
    a = torch.cat([column, others, column], dim=1)
    b = a[:, :3] @ torch.tensor([[2.0], [1.0], [-1.0]])
    torch.testing.assert_close(solve(a, b), torch.tensor([[1.0], [1.0], [-1.0], [1.0]]), atol=1e-5, rtol=0)
    eye = torch.eye(5)
    eye[0, 0] = 0
    assert torch.equal(solve(eye, torch.ones(5, 1)), torch.tensor([[0.0], [1.0], [1.0], [1.0], [1.0]]))
    wide = torch.randn(3, 7, generator=g, dtype=torch.float64)
    rhs = torch.randn(3, 2, generator=g, dtype=torch.float64)
    torch.testing.assert_close(solve(wide, rhs), wide.T @ torch.linalg.solve(wide @ wide.T, rhs))
    assert torch.equal(solve(torch.zeros(6, 3), torch.ones(6, 1)), torch.zeros(3, 1))


def test_each_item_is_the_same_bits_alone_as_in_its_batch() -> None:
    """A token's coefficients do not follow the other tokens of its batch, a rank-deficient one before it
    included (gelsy carried an item's pivots into the next)."""
    g = torch.Generator().manual_seed(14)
    a, b = torch.randn(6, 24, 8, generator=g), torch.randn(6, 24, 1, generator=g)
    a[2, :, 5] = a[2, :, 1]
    together = least_squares(a, b)
    for i in range(a.shape[0]):
        assert torch.equal(least_squares(a[i:i + 1], b[i:i + 1])[0], together[i]), i


def test_two_equal_neighbours_get_the_least_squares_fit_that_mergekit_misses() -> None:
    """0.1.5's weights of a batch where each target has two equal neighbours: its solver (gelsy with pivots read
    from uninitialized memory) kept fewer columns than the rank (3 of 5 in a run here), so its fit is no least-squares
    fit; resumerge's reaches the least residual, splits the weight evenly between the equal two, and agrees with
    0.1.5's on the batch's full-rank rows."""
    from mergekit.tokensurgeon.common_interpolation import WeightingScheme, approximate_from_landmarks

    g = torch.Generator().manual_seed(15)
    points = torch.randn(8, 6, 16, generator=g)
    points[:4, 3] = points[:4, 1]  # the first four targets have two equal neighbours
    targets = torch.randn(8, 16, generator=g)
    ours = least_squares(points.transpose(1, 2), targets.unsqueeze(-1)).squeeze(-1)
    theirs = approximate_from_landmarks(targets, points, torch.ones(8, 6), WeightingScheme.LEAST_SQUARES)

    def residual(weights: torch.Tensor) -> torch.Tensor:
        return (torch.bmm(weights.unsqueeze(1), points).squeeze(1) - targets).norm(dim=1)

    assert bool((residual(ours) <= residual(theirs) + 1e-5).all())
    torch.testing.assert_close(ours[:4, 1], ours[:4, 3], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[4:], theirs[4:], atol=1e-5, rtol=1e-5)

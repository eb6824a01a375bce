"""The pursuit's screened pick (bfloat16 estimates, a bound, float32 scores of the few candidates left): the same
picks and coefficients, bit for bit, as the whole float32 product's, near ties and fallbacks included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from resumerge.machine.torch_import import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The pursuit screens only on one thread (as the engine's CPU units and batch workers run), and only where
    the CPU multiplies bfloat16 natively and its float32 product keeps the screen's premise
    (:func:`omp.gathers_exactly`): elsewhere there is nothing screened to compare."""
    from resumerge.runs.transplant import omp

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            pytest.skip("this CPU has no native bfloat16 products: the pursuit takes the whole product")
        if not omp.gathers_exactly(64):
            pytest.skip("this machine's float32 product gives a gathered block other bits: no screen")
        yield
    finally:
        torch.set_num_threads(before)


def _pair(seed: int, rows: int, atoms: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(atoms, width, generator=g) * (0.2 + 5 * torch.rand(atoms, 1, generator=g))
    # Near ties decided by the last bits: atoms repeated, and repeated with a one-ulp-sized nudge.
    a[atoms // 2:atoms // 2 + 20] = a[:20]
    a[atoms // 2 + 20:atoms // 2 + 40] = a[20:40] * (1 + 2.0 ** -23)
    t = torch.randn(rows, width, generator=g)
    # Targets that are atoms: the residual is rounding after one step (the screen gives way to the whole product).
    t[:3] = a[[5, atoms // 2 + 25, atoms - 1]]
    # Targets between near-tied atoms.
    t[3:6] = a[[21, 22, 23]] + 1e-3 * torch.randn(3, width, generator=g)
    return t, a


@pytest.mark.parametrize(("rows", "atoms", "width", "k"),
                         [(16, 400, 48, 12), (40, 700, 96, 24), (70, 1500, 128, 8), (64, 4000, 576, 24)])
def test_screened_picks_are_the_whole_products_bits(rows: int, atoms: int, width: int, k: int, one_thread: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.runs.transplant import omp

    targets, points = _pair(rows + atoms, rows, atoms, width)
    assert omp.screens(targets, points, k)
    outcomes: list[bool] = []
    pick = omp.Screen.pick

    def counted(self: omp.Screen, *args: object) -> torch.Tensor | None:
        best = pick(self, *args)  # type: ignore[arg-type]
        outcomes.append(best is not None)
        return best

    monkeypatch.setattr(omp.Screen, "pick", counted)
    screened = omp.batch_omp(targets, points, k)
    assert any(outcomes), "no step was screened"
    monkeypatch.setattr(omp, "screens", lambda *_: False)
    whole = omp.batch_omp(targets, points, k)
    assert torch.equal(screened[0], whole[0])
    assert torch.equal(screened[1], whole[1])


def test_a_step_of_too_many_candidates_takes_the_whole_product(one_thread: None) -> None:
    """Every target an atom: after the first step every residual is rounding, no estimate bounds the pick, and
    the step scores every atom in float32 (the same picks as without a screen)."""
    from resumerge.runs.transplant import omp

    _, points = _pair(7, 16, 500, 64)
    targets = points[100:132].clone()
    screen = omp.Screen.of(points, len(targets))
    picked = torch.zeros((len(targets), 4), dtype=torch.long)
    picked[:, 0] = torch.arange(100, 132)
    residual = targets - targets  # all zero: every score ties
    assert screen.pick(residual, points, picked, 1) is None


def test_a_gathered_products_elements_are_the_whole_products_where_the_screen_is_used(one_thread: None) -> None:
    """What the screen rests on: an element of the float32 product of 16 to 63 gathered rows and 16 or more
    gathered columns has the whole product's bits (MKL, one thread) — on every width the screen is used for; where
    this machine's kernels sum a gather in another order, the screen is off for that width."""
    from resumerge.runs.transplant import omp

    g = torch.Generator().manual_seed(11)
    for width, rows in ((64, 512), (576, 512), (640, 40), (2048, 64)):
        atoms, residual = torch.randn(3000, width, generator=g), torch.randn(rows, width, generator=g)
        whole = torch.mm(residual, atoms.T)
        exact = True
        for block in (b for b in (16, 31, 32, 63) if b <= rows):  # a block is never more rows than the batch
            first = (rows - block) // 3
            for columns in (16, 17, 40, 333, 2999):
                picked = torch.randperm(3000, generator=g)[:columns].sort().values
                part = torch.mm(residual[first:first + block], atoms[picked].T)
                exact = exact and torch.equal(part, whole[first:first + block][:, picked])
        assert exact or not omp.gathers_exactly(width), width  # the probe turns the screen off where it fails


def test_the_pursuit_screens_only_where_its_picks_stay_the_same(one_thread: None) -> None:
    from resumerge.runs.transplant import omp

    targets, points = _pair(3, 32, 600, 64)
    assert omp.screens(targets, points, 8)
    assert not omp.screens(targets.double(), points.double(), 8)
    assert not omp.screens(targets[:8], points, 8)  # too few rows to gather
    assert not omp.screens(targets, points[:200], 8)  # too few atoms
    torch.set_num_threads(2)
    assert not omp.screens(targets, points, 8)  # a product split over threads


def test_a_machine_whose_gathered_products_differ_takes_the_whole_product(one_thread: None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a gathered block's elements would not be the whole product's bits, no step is screened, so the picks
    are the whole product's whatever the BLAS does."""
    from resumerge.runs.transplant import omp

    targets, points = _pair(5, 32, 600, 64)
    assert omp.screens(targets, points, 8)
    real = torch.mm

    def nudged(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
        out = real(a, b, **kw)  # type: ignore[call-overload]
        if a.shape[0] < 64 and not kw:
            out = out * (1 + 2.0 ** -23)  # a block's kernel that rounds otherwise
        return out

    monkeypatch.setattr(omp.torch, "mm", nudged)
    assert not omp.gathers_exactly(64)
    assert not omp.screens(targets, points, 8)

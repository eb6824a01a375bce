"""Task-vector sparsifiers (TIES magnitude, breadcrumbs, DARE, DELLA) used by the task-arithmetic family."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resumerge.merge.methods import sparsify
from resumerge.merge.methods.summation import ordered_sum

DELTA = torch.tensor([[3.0, -1.0, 0.5], [2.0, 0.0, -4.0]])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_magnitude_keeps_the_largest_entries() -> None:
    out = sparsify.magnitude(DELTA, 0.5, rescale=False)  # k = 3 of 6
    assert torch.equal(out, torch.tensor([[3.0, 0.0, 0.0], [2.0, 0.0, -4.0]]))


def test_magnitude_rescale_restores_the_l1_norm() -> None:
    out = sparsify.magnitude(DELTA, 0.5, rescale=True)
    # |δ|₁ = 10.5, kept |·|₁ = 9
    assert torch.allclose(out, torch.tensor([[3.0, 0.0, 0.0], [2.0, 0.0, -4.0]]) * (10.5 / 9))


def test_magnitude_keeps_at_least_one_and_density_bounds() -> None:
    assert torch.count_nonzero(sparsify.magnitude(DELTA, 0.01, rescale=False)) == 1
    assert torch.equal(sparsify.magnitude(DELTA, 0.0, rescale=False), torch.zeros(2, 3))
    assert sparsify.magnitude(DELTA, 1.0, rescale=True) is DELTA


def test_magnitude_outliers_drops_the_top_gamma_then_the_smallest() -> None:
    # keep ⌊0.5·6⌋ = 3 after skipping max(0, 6 − 3 − ⌊0.2·6⌋) = 2 smallest: drops 0, 0.5 and the outlier −4
    out = sparsify.magnitude_outliers(DELTA, 0.5, 0.2, rescale=False)
    assert torch.equal(out, torch.tensor([[3.0, -1.0, 0.0], [2.0, 0.0, 0.0]]))


def test_magnitude_outliers_keeps_outliers_when_density_needs_them() -> None:
    # skipping 6 − 5 − 1 = 0 small entries: the window is the five smallest, so only the largest goes
    out = sparsify.magnitude_outliers(DELTA, 5 / 6, 0.2, rescale=False)
    assert torch.equal(out, torch.tensor([[3.0, -1.0, 0.5], [2.0, 0.0, 0.0]]))


def test_bernoulli_keep_rate_and_l1_rescale() -> None:
    delta = torch.ones(200_000)
    out = sparsify.sample(delta, sparsify.Sampled(0.3), rescale=True, generator=gen())
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.3) < 0.005
    # every kept entry is scaled by N/kept, so the L1 norm is preserved (not 1/density)
    assert torch.allclose(out[kept], torch.full_like(out[kept], 200_000 / kept.sum().item()))
    assert out.abs().sum().item() == pytest.approx(200_000, rel=1e-5)


def test_bernoulli_without_rescale_only_masks() -> None:
    out = sparsify.sample(DELTA, sparsify.Sampled(0.5), rescale=False, generator=gen())
    assert torch.equal(out[out != 0], DELTA[out != 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_random_sparsifiers_keep_dtype_and_shape(dtype: torch.dtype) -> None:
    delta = torch.randn(4, 5, generator=gen(1)).to(dtype)
    for out in (
        sparsify.sample(delta, sparsify.Sampled(0.5), rescale=True, generator=gen()),
        sparsify.sample(delta, sparsify.Sampled(0.5, 0.2), rescale=True, generator=gen()),
    ):
        assert out.dtype == dtype and out.shape == delta.shape


def test_random_sparsifiers_require_a_generator() -> None:
    with pytest.raises(ValueError, match="Generator"):
        sparsify.sample(DELTA, sparsify.Sampled(0.5), rescale=True, generator=None)
    with pytest.raises(ValueError, match="Generator"):
        sparsify.sample(DELTA, sparsify.Sampled(0.5, 0.1), rescale=True, generator=None)


def test_random_sparsifiers_never_touch_the_global_rng() -> None:
    state = torch.get_rng_state()
    sparsify.sample(DELTA, sparsify.Sampled(0.5), rescale=True, generator=gen())
    sparsify.sample(DELTA, sparsify.Sampled(0.5, 0.1), rescale=True, generator=gen())
    assert torch.equal(torch.get_rng_state(), state)


def test_della_keep_probability_rises_with_magnitude_rank() -> None:
    row = torch.arange(1, 100_001, dtype=torch.float32)[torch.randperm(100_000, generator=gen(3))]
    out = sparsify.sample(row, sparsify.Sampled(0.5, 0.4), rescale=False, generator=gen())
    kept = (out != 0).float()
    order = torch.argsort(row)
    # p runs linearly from 0.1 (smallest) to 0.9 (largest): the bottom tenth keeps ≈ 0.14, the top ≈ 0.86
    assert abs(kept[order[:10_000]].mean().item() - 0.14) < 0.02
    assert abs(kept[order[-10_000:]].mean().item() - 0.86) < 0.02
    assert abs(kept.mean().item() - 0.5) < 0.01


def test_della_ranks_each_row_separately() -> None:
    # Two rows of very different scale: per-row ranking keeps about half of each.
    rows = torch.stack([torch.linspace(1, 2, 20_000), torch.linspace(1000, 2000, 20_000)])
    kept = (sparsify.sample(rows, sparsify.Sampled(0.5, 0.3), rescale=False, generator=gen()) != 0).float()
    assert abs(kept[0].mean().item() - 0.5) < 0.02
    assert abs(kept[1].mean().item() - 0.5) < 0.02


def test_della_single_entry_rows_use_density() -> None:
    column = torch.ones(50_000, 1)
    kept = (sparsify.sample(column, sparsify.Sampled(0.3, 0.2), rescale=False, generator=gen()) != 0).float()
    assert abs(kept.mean().item() - 0.3) < 0.01


def test_della_rejects_epsilon_leaving_the_unit_interval() -> None:
    with pytest.raises(ValueError, match=r"density \+/- epsilon"):
        sparsify.sample(DELTA, sparsify.Sampled(0.9, 0.15), rescale=True, generator=gen())
    # density ≥ 1 disables pruning before the check, as in mergekit
    assert sparsify.sample(DELTA, sparsify.Sampled(1.0, 0.15), rescale=True, generator=gen()) is DELTA


@settings(deadline=None, max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), density=st.floats(0.05, 0.95))
def test_random_sparsifiers_are_deterministic_per_seed(seed: int, density: float) -> None:
    delta = torch.randn(8, 16, generator=gen(7))
    epsilon = min(density, 1 - density) / 2
    for sampled in (sparsify.Sampled(density), sparsify.Sampled(density, epsilon)):
        first = sparsify.sample(delta, sampled, rescale=True, generator=gen(seed))
        # an unrelated call between
        sparsify.sample(torch.randn(5, 4), sampled, rescale=True, generator=gen(seed + 1))
        assert torch.equal(first, sparsify.sample(delta, sampled, rescale=True, generator=gen(seed)))


def _masked_by_hand(delta: torch.Tensor, mask: torch.Tensor, rescale: bool) -> torch.Tensor:
    # The mask, then the L1 rescale over the whole tensor (both norms ordered sums, unscaled below RESCALE_EPS).
    masked = delta * mask
    if rescale:
        before, after = ordered_sum(delta.abs()), ordered_sum(masked.abs())
        if before >= sparsify.RESCALE_EPS and after >= sparsify.RESCALE_EPS:
            masked *= before / after
    return masked


def _della_unfused(delta: torch.Tensor, density: float, epsilon: float, seed: int, rescale: bool) -> torch.Tensor:
    # The float32 path as it ran before masks were applied block by block: the whole mask first, then the mask and
    # the L1 rescale over the whole tensor.
    rows = delta if delta.dim() == 2 else delta.reshape(1, -1)
    table = sparsify._probability_table(rows.shape[1], density, epsilon, torch.float32, rows.device)
    probabilities = sparsify._rank_probabilities(rows.abs(), table, torch.float32)
    mask = sparsify.bernoulli_mask(probabilities, gen(seed), torch.float32)
    return _masked_by_hand(rows.clone(), mask, rescale).reshape(delta.shape)


@pytest.mark.parametrize("block", [1, 37, 1 << 17])
@pytest.mark.parametrize("rescale", [True, False])
@pytest.mark.parametrize("shape", [(48, 31), (5, 1), (1, 200), (300,)], ids=str)
def test_della_float32_masks_in_blocks_with_the_unfused_bits(
    monkeypatch: pytest.MonkeyPatch, block: int, rescale: bool, shape: tuple[int, ...]
) -> None:
    # Equal magnitudes (rounded values) and exact zeros in every row: the tie rule and the zero rows are exercised.
    delta = (torch.randn(shape, generator=gen(7)) * 4).round() / 4
    monkeypatch.setattr(sparsify, "_ROW_BLOCK_ELEMENTS", block)
    ours = sparsify.sample(delta, sparsify.Sampled(0.4, 0.15), rescale=rescale, generator=gen(3))
    assert ours.dtype == torch.float32 and ours.shape == delta.shape
    assert torch.equal(ours.view(torch.int32), _della_unfused(delta, 0.4, 0.15, 3, rescale).view(torch.int32))


def test_della_float32_leaves_its_input_alone_unless_in_place() -> None:
    delta = torch.randn(16, 16, generator=gen(1))
    before = delta.clone()
    out = sparsify.sample(delta, sparsify.Sampled(0.5, 0.1), rescale=True, generator=gen(2))
    assert torch.equal(delta, before) and out.data_ptr() != delta.data_ptr()
    again = sparsify.sample(delta, sparsify.Sampled(0.5, 0.1), rescale=True, generator=gen(2), inplace=True)
    assert again.data_ptr() == delta.data_ptr() and torch.equal(again, out)


@pytest.mark.parametrize("block", [1, 37, 1 << 17])
@pytest.mark.parametrize("rescale", [True, False])
@pytest.mark.parametrize("shape", [(48, 31), (300,), (2, 3, 5)], ids=str)
def test_bernoulli_float32_masks_in_blocks_with_the_unfused_bits(
    monkeypatch: pytest.MonkeyPatch, block: int, rescale: bool, shape: tuple[int, ...]
) -> None:
    delta = torch.randn(shape, generator=gen(4))
    probabilities = torch.tensor(0.35, dtype=torch.float32).expand(shape)
    mask = sparsify.bernoulli_mask(probabilities, gen(9), torch.float32)
    unfused = _masked_by_hand(delta.clone(), mask, rescale)
    monkeypatch.setattr(sparsify, "_ROW_BLOCK_ELEMENTS", block)
    ours = sparsify.sample(delta, sparsify.Sampled(0.35), rescale=rescale, generator=gen(9))
    assert torch.equal(ours.view(torch.int32), unfused.view(torch.int32))
    # The generator has advanced by exactly one draw per entry, as one draw over the whole tensor advances it.
    follower = gen(9)
    torch.empty(delta.numel()).uniform_(generator=follower)
    after = gen(9)
    sparsify.sample(delta, sparsify.Sampled(0.35), rescale=rescale, generator=after)
    assert torch.equal(torch.rand(4, generator=after), torch.rand(4, generator=follower))


@pytest.mark.parametrize("span", [1, 100, 250])
@pytest.mark.parametrize("dare", [False, True], ids=["della", "dare"])
def test_magnitudes_taken_in_spans_keep_the_unfused_bits(
    monkeypatch: pytest.MonkeyPatch, span: int, dare: bool
) -> None:
    # Blocks of 2 rows (62 entries) or 37 entries; spans of one block (span 1), of a few with a shorter last one
    # (100, 250): the norms are fed span by span and the ranks read the span's buffer, with the whole's bits.
    delta = (torch.randn(48, 31, generator=gen(5)) * 4).round() / 4
    monkeypatch.setattr(sparsify, "_ROW_BLOCK_ELEMENTS", 37 if dare else 62)
    monkeypatch.setattr(sparsify, "_SPAN_ELEMENTS", span)
    if dare:
        mask = sparsify.bernoulli_mask(torch.tensor(0.35).expand(delta.shape), gen(9), torch.float32)
        expected = _masked_by_hand(delta.clone(), mask, True)
        ours = sparsify.sample(delta, sparsify.Sampled(0.35), rescale=True, generator=gen(9))
    else:
        expected = _della_unfused(delta, 0.4, 0.15, 3, True)
        ours = sparsify.sample(delta, sparsify.Sampled(0.4, 0.15), rescale=True, generator=gen(3))
    assert torch.equal(ours.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(20, 7, 9), (40, 33)], ids=str)
def test_della_spans_keep_every_dtypes_bits(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                            shape: tuple[int, ...]) -> None:
    # Rows ranked along dim 1 (a 3-D tensor's too), in blocks and spans cut small, equal the one-span draw.
    delta = ((torch.randn(shape, generator=gen(11)) * 8).round() / 8).to(dtype)
    whole = sparsify.sample(delta, sparsify.Sampled(0.5, 0.2), rescale=True, generator=gen(4))
    monkeypatch.setattr(sparsify, "_ROW_BLOCK_ELEMENTS", 2 * math.prod(shape[1:]))
    monkeypatch.setattr(sparsify, "_SPAN_ELEMENTS", 5 * math.prod(shape[1:]))
    cut = sparsify.sample(delta, sparsify.Sampled(0.5, 0.2), rescale=True, generator=gen(4))
    assert cut.dtype == dtype and torch.equal(cut.view(torch.uint8), whole.view(torch.uint8))
    assert 0 < int(torch.count_nonzero(cut)) < cut.numel()


@pytest.mark.parametrize("rescale", [True, False])
def test_draws_sharing_one_scratch_keep_the_bits_of_draws_alone(monkeypatch: pytest.MonkeyPatch,
                                                                rescale: bool) -> None:
    # One Scratch lent to task vectors drawn in turn — DELLA and DARE, every dtype, rows of different lengths, a
    # larger one after smaller ones (its buffers grow) and a smaller one after it (a prefix of them, with what the
    # larger one left there) — gives each draw the bits it has with buffers of its own; the norms' waiting numbers
    # are kept in it too (spans cut short of the ordered sums' blocks).
    monkeypatch.setattr(sparsify, "_ROW_BLOCK_ELEMENTS", 3 * 64)
    monkeypatch.setattr(sparsify, "_SPAN_ELEMENTS", 7 * 64)
    scratch = sparsify.Scratch()
    cases = [((24, 31), torch.float32, sparsify.Sampled(0.4, 0.15)), ((9, 64, 3), torch.bfloat16,
             sparsify.Sampled(0.5, 0.2)), ((300, 64), torch.float32, sparsify.Sampled(0.3, 0.1)),
             ((50, 17), torch.float16, sparsify.Sampled(0.6, 0.1)), ((40, 33), torch.float64, sparsify.Sampled(0.5)),
             ((7, 5), torch.float32, sparsify.Sampled(0.35))]
    for seed, (shape, dtype, sampled) in enumerate(cases):
        delta = ((torch.randn(shape, generator=gen(seed)) * 8).round() / 8).to(dtype)
        alone = sparsify.sample(delta, sampled, rescale=rescale, generator=gen(seed))
        shared = sparsify.sample(delta, sampled, rescale=rescale, generator=gen(seed), scratch=scratch)
        assert torch.equal(shared.view(torch.uint8), alone.view(torch.uint8)), (shape, dtype, sampled)
    scratch.clear()
    assert torch.equal(sparsify.sample(DELTA, sparsify.Sampled(0.5, 0.2), rescale=rescale, generator=gen(1),
                                       scratch=scratch),
                       sparsify.sample(DELTA, sparsify.Sampled(0.5, 0.2), rescale=rescale, generator=gen(1)))

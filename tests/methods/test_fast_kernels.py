"""The fast kernels behind DARE, DELLA, SCE and the TIES sign election equal the torch calls they replace, bit for bit.

Each replaces one torch call that mergekit makes (``torch.bernoulli``, ``torch.var``, a bool sign mask) with a
cheaper computation of the same numbers; these tests pin the equality for the installed torch, including the
generator's state afterwards and the special values (±0, ±inf, NaN).
"""

from __future__ import annotations

import pytest
import torch

from resumerge.merge.methods import sce_steps, sparsify
from resumerge.merge.methods.consensus import sign_consensus_weights

SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(BITS[tensor.dtype])


def _with_specials(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * torch.logspace(-6, 2, shape[-1])
    flat = values.view(-1)
    places = torch.randperm(flat.numel(), generator=generator)[: 4 * len(SPECIALS)]
    flat[places] = torch.tensor(SPECIALS * 4)
    return values.to(dtype)


@pytest.mark.parametrize("draw", [torch.float32, torch.bfloat16])
def test_bernoulli_mask_draws_what_torch_bernoulli_draws(draw: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    # Varying probabilities, a permuted (non-contiguous) layout as DELLA's rows of a 3-D tensor give, and a
    # constant probability expanded as DARE passes it.
    varying = torch.rand(4, 33, 65, generator=generator).to(draw).movedim(1, -1)
    constant = torch.tensor(0.3, dtype=draw).expand(5, 77)
    for probabilities in (varying, constant):
        ours, theirs = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        mask = sparsify.bernoulli_mask(probabilities, ours, torch.float32)
        expected = torch.bernoulli(probabilities.contiguous(), generator=theirs).float()
        assert torch.equal(mask, expected)
        assert 0 < int(mask.sum()) < mask.numel()
        assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("count", [2, 3])
def test_population_variance_is_torch_var(
    dtype: torch.dtype, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sce_steps, "_VARIANCE_BLOCK", 64)  # several blocks and a partial last one
    stacked = _with_specials((count, 7, 45), dtype, seed=count)
    expected = torch.var(stacked, dim=0, unbiased=False)
    got = sce_steps.population_variance(stacked)
    assert got.shape == expected.shape and got.dtype == dtype
    # Bit for bit but for a NaN's sign, which SCE drops (it ranks |variance|).
    assert torch.equal(_bits(got.abs()), _bits(expected.abs()))
    assert torch.equal(_bits(got[~got.isnan()]), _bits(expected[~expected.isnan()]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_sign_consensus_weights_are_the_bool_mask_as_numbers(dtype: torch.dtype) -> None:
    deltas = _with_specials((3, 9, 31), dtype, seed=5)
    deltas[:, 0, :4] = torch.tensor([[1.0, 0.0, -0.0, 2.0], [-1.0, 0.0, 0.0, -2.0], [0.0, -0.0, 0.0, 0.0]]).to(dtype)
    weights = sign_consensus_weights(deltas)
    assert weights.dtype == dtype
    # mergekit's definition: the sign of the sum elects (a zero sum elects +), and an entry is kept where its own
    # sign equals the elected one (zeros and NaN never do).
    elected = torch.where(deltas.sum(dim=0) >= 0, 1.0, -1.0).to(dtype)
    mask = torch.sign(deltas) == elected
    assert torch.equal(_bits(weights), _bits(mask.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_della_row_blocks_draw_the_whole_tensor_mask(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    magnitudes = _with_specials((13, 40), dtype, seed=7).abs()
    draw = torch.float32 if dtype == torch.float32 else torch.bfloat16
    table = sparsify._probability_table(magnitudes.shape[1], 0.5, 0.2, draw, magnitudes.device)
    whole = sparsify.bernoulli_mask(
        sparsify._rank_probabilities(magnitudes, table, draw), torch.Generator().manual_seed(2), dtype
    )
    monkeypatch.setattr(sparsify, "_ROW_BLOCK_ELEMENTS", 120)  # blocks of 3 rows and a last one of 1
    blocks = torch.empty(magnitudes.numel(), dtype=dtype)
    sparsify.draw_and_mask(magnitudes.clone(), sparsify.Sampled(0.5, 0.2), torch.Generator().manual_seed(2),
                           keep=blocks)
    blocks = blocks.view(magnitudes.shape)
    assert torch.equal(blocks, whole)

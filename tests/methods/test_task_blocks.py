"""A generation's candidate merged from the task vectors and keys the candidates share, its windows' masks made block
by block (:mod:`resumerge.merge.methods.task_blocks`): the bits of the merge alone, for every rank-window member."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from methods.test_task_stream import bits, inputs
from resumerge.merge.methods import MergeContext, get_method, task_blocks, task_vectors
from resumerge.merge.methods.spec import InputsOnly
from resumerge.merge.methods.task_stream import TASK_KEY_COUNTS, TASK_KEYS, magnitude_selector, outlier_selector
from resumerge.merge.methods.task_vectors import TASK_VECTOR

METHODS = ["ties", "breadcrumbs", "breadcrumbs_ties"]


class Memo:
    """Values of the inputs alone, computed once and kept (as a generation's block keeps them)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int], torch.Tensor] = {}

    def value(self, what: InputsOnly, index: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if (what.name, index) not in self.kept:
            self.kept[(what.name, index)] = compute()
        return self.kept[(what.name, index)]


def merges(method: str, tensors: Sequence[torch.Tensor], model_params: Sequence[dict[str, Any]],
           params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(the merge alone, the block-by-block merge from shared values or None, that method's merge with the
    memo)."""
    spec = get_method(method)
    assert spec is not None
    bound_models, bound = spec.bind(model_params, params, 0)
    alone = spec.fn(MergeContext([t.clone() for t in tensors], 0, bound_models, bound))
    ctx = MergeContext(list(tensors), 0, bound_models, bound, memo=Memo())
    selector = magnitude_selector if method == "ties" else outlier_selector
    selections = {i: selector(tensors[0].numel(), bound_models[i]) for i in ctx.others()}
    blocks = task_blocks.shared_window_merge(ctx, selections, consensus=method != "breadcrumbs", keys=TASK_KEYS,
                                             counts=TASK_KEY_COUNTS)
    shared = spec.fn(MergeContext(list(tensors), 0, bound_models, bound, memo=Memo()))
    return alone, blocks, shared


def _params(weights: Sequence[float], densities: Sequence[float], gamma: float = 0.01) -> list[dict[str, Any]]:
    return [{}, *({"weight": w, "density": d, "gamma": gamma} for w, d in zip(weights, densities, strict=True))]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("block", [None, 5003])
def test_blocks_from_shared_values_give_the_bits_of_the_merge_alone(method: str, block: int | None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 × 450 entries: two blocks of the combine (and many of 5003); few distinct magnitudes (levels), so the
    # runs of equal keys at the windows' ends straddle blocks, and a scan of a few thousand keys a step looks for
    # their cuts.
    monkeypatch.setattr(task_blocks, "_SCAN", 4099)
    if block is not None:
        monkeypatch.setattr(task_vectors, "_FILLED_BLOCK_ENTRIES", block)
    cases = [((0.6, 0.4), (0.5, 0.3), {}), ((0.3, 0.9), (0.9, 0.07), {"normalize": False}),
             ((-0.5, 1.2), (0.2, 1.0), {"lambda": 0.7}), ((1.0, 0.25), (0.0, 0.999), {})]
    for seed, levels in ((1, 3), (2, None), (3, 40)):
        tensors = inputs(torch.bfloat16, (300, 450), seed, levels)
        for weights, densities, params in cases:
            alone, blocks, shared = merges(method, tensors, _params(weights, densities, 0.05), params)
            assert blocks is not None
            assert torch.equal(bits(blocks), bits(alone)), (seed, weights, densities, params)
            assert torch.equal(bits(shared), bits(alone))


@pytest.mark.parametrize("method", METHODS)
def test_three_models_and_signed_zeros(method: str) -> None:
    g = torch.Generator().manual_seed(7)
    base = (torch.randint(-2, 3, (90, 800), generator=g).float() * 0.5).to(torch.bfloat16)
    tensors = [base]
    for _ in range(3):
        delta = torch.randint(-2, 3, (90, 800), generator=g).float() * 0.25
        delta[delta == 0] = -0.0
        tensors.append(base + delta.to(torch.bfloat16))
    tensors[1][0, :10] = base[0, :10]  # exact zeros of both signs in the task vectors
    alone, blocks, _ = merges(method, tensors, _params((0.5, -0.3, 0.8), (0.4, 0.6, 0.3)), {})
    assert blocks is not None and torch.equal(bits(blocks), bits(alone))


def test_an_infinite_or_nan_task_vector_or_another_dtype_is_merged_the_whole_way() -> None:
    tensors = inputs(torch.bfloat16, (20, 30), 4, 3)
    tensors[1][3, 4] = float("inf")
    alone, blocks, shared = merges("ties", tensors, _params((0.6, 0.4), (0.5, 0.5)), {})
    assert blocks is None and torch.equal(bits(shared), bits(alone))
    tensors[1][3, 4] = float("nan")
    alone, blocks, shared = merges("ties", tensors, _params((0.6, 0.4), (0.5, 0.5)), {})
    assert blocks is None and torch.equal(bits(shared), bits(alone))
    alone, blocks, shared = merges("ties", inputs(torch.float32, (20, 30), 4, 3), _params((0.6, 0.4), (0.5, 0.5)),
                                   {})
    assert blocks is None and torch.equal(bits(shared), bits(alone))


def test_a_merge_with_shared_values_takes_the_blocks() -> None:
    # Only the blocks read the keys' shared histogram (a whole merge's window selects among the keys).
    tensors = inputs(torch.bfloat16, (400, 600), 5, 3)
    memo = Memo()
    spec = get_method("ties")
    assert spec is not None
    bound_models, bound = spec.bind(_params((0.6, 0.4), (0.5, 0.3)), {}, 0)
    ctx = MergeContext(list(tensors), 0, bound_models, bound, memo=memo)
    spec.fn(ctx)
    assert {name for name, _ in memo.kept} == {TASK_VECTOR.name, TASK_KEYS.name, TASK_KEY_COUNTS.name}


@pytest.mark.parametrize("weights", [(0.6, 0.4), (-0.5, 1.25), (3e38, 2.0), (0.0, -0.0), (1.0, -1.0)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("finite", [True, False])
def test_the_elected_pair_kernel_has_the_combines_bits_on_every_bit_pattern(weights: tuple[float, float],
                                                                            normalize: bool, finite: bool) -> None:
    # Every bfloat16 bit pattern (finite: every finite one; else NaNs and infinities too, where the sum falls back
    # to torch's) against every other, shuffled, and exact cancellations (b = -a), over a base of -0 at every other
    # position: the bits of the combine's own block.
    g = torch.Generator().manual_seed(11)
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if finite:
        patterns = patterns[patterns.isfinite()]
    half = patterns.numel() // 2
    a = patterns[torch.randperm(patterns.numel(), generator=g)]
    b = torch.cat([patterns[torch.randperm(patterns.numel(), generator=g)][:half], -a[half:]])
    a[:999], b[:999] = -0.0, -0.0  # (dropped negative entries, as a window leaves them: their sum is a zero)
    w = torch.tensor(weights, dtype=torch.bfloat16).reshape(2, 1)
    base = patterns[torch.randperm(patterns.numel(), generator=g)]
    base[::2] = -0.0  # where the sum of what is kept is a zero, its sign reaches the output only here
    want, got = torch.empty_like(base), torch.empty_like(base)
    task_vectors._combine_block(torch.stack([a, b]), w, base, want, consensus=True, normalize=normalize, scale=0.5)
    task_blocks._ElectedPair(normalize=normalize, scale=0.5)(torch.stack([a, b]), w, base, got)
    assert torch.equal(bits(got), bits(want))

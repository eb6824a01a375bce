"""The inputs a method is timed on where the plan's own are not on disk (hub files not downloaded, a recipe's
earlier stage not run yet): synthetic tensors of their shapes and dtype, a random base and small deltas from it, like
fine-tunes of one model (:mod:`resumerge.analyses.estimate.compute`)."""

from __future__ import annotations

from functools import reduce

from resumerge.inputs.tensorio import NAME_DTYPES, TORCH_DTYPES
from resumerge.machine.torch_import import torch
from resumerge.merge.methods.regmean import GRAM
from resumerge.merge.plan.merge_plan import TensorPlan


def synthetic_inputs(tp: TensorPlan, device: torch.device, *, grams: bool = False) -> list[torch.Tensor]:
    """Random inputs of ``tp``'s shapes and dtype: a base and small deltas from it, like fine-tunes of one model.
    With ``grams`` (a method given its weights' Gram matrices,
    :attr:`~resumerge.merge.methods.spec.MethodSpec.gram_inputs`) each input the plan marks as a Gram is made symmetric
    positive definite, as a measured Gram is: a random matrix (or, for a square weight, a delta of it) is not, its
    Cholesky factorisation fails and the solve takes the pseudo-inverse, which real Grams do not."""
    # The dtype the inputs compute in: the one planned, else their stored one (torch's promotion of several).
    stored = (TORCH_DTYPES[d] for d in tuple(i.value_dtype for i in tp.inputs) or (tp.out_dtype,))
    dtype = NAME_DTYPES[tp.compute_dtype] if tp.compute_dtype else reduce(torch.promote_types, stored)
    generator = torch.Generator().manual_seed(0)
    marked = [grams and bool(dict(p).get(GRAM)) and _square(ref.shape) for p, ref in zip(tp.model_params, tp.inputs)]
    base = torch.randn(tp.inputs[0].shape, generator=generator)
    # An input of another shape than the first is no fine-tune of it (core_space's LoRA factors): random alone.
    made = [_gram(ref.shape[0], generator) if gram else base if i == 0 else
            base + 0.01 * torch.randn(ref.shape, generator=generator) if ref.shape == base.shape
            else torch.randn(ref.shape, generator=generator)
            for i, (ref, gram) in enumerate(zip(tp.inputs, marked))]
    return [t.to(device=device, dtype=dtype) for t in made]


def _square(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[0] == shape[1]


def _gram(n: int, generator: torch.Generator) -> torch.Tensor:
    """An n x n symmetric matrix with its eigenvalues within [0.5, 1.5] (a symmetric random matrix of entries of
    spread s has its eigenvalues within 2·s·√n): well conditioned, made in O(n²)."""
    noise = torch.randn(n, n, generator=generator)
    symmetric = (noise + noise.T) / (2 * 2 ** 0.5)  # entries of spread 1/√2 off the diagonal
    return torch.eye(n).add_(symmetric, alpha=1 / (4 * (2 * n) ** 0.5))

"""``sce``: Select high-variance positions, Calculate weights from task-vector energy, Erase sign conflicts.

Reference: https://arxiv.org/abs/2408.07990 (FuseChat 2.0).
"""

from __future__ import annotations

import torch

from resumerge.methods.consensus import sign_consensus_mask
from resumerge.methods.ranking import magnitude_keys, rank_window
from resumerge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, register


def variance_mask(task_vectors: torch.Tensor, fraction: float, dtype: torch.dtype) -> torch.Tensor:
    """Mark the ``int(fraction · #positions of nonzero variance)`` positions of top variance across models.

    ``task_vectors`` is stacked along dim 0; the mask has the shape of one task vector. ``fraction ≤ 0`` marks
    nothing and ``fraction ≥ 1`` everything. Equal variances straddling the cut are kept lowest index first
    (mergekit keeps whichever torch's ``topk`` returns, an order that differs between CPU and GPU).
    """
    if fraction <= 0:
        return torch.zeros_like(task_vectors[0], dtype=dtype)
    if fraction >= 1:
        return torch.ones_like(task_vectors[0], dtype=dtype)
    variance = torch.var(task_vectors, dim=0, unbiased=False)
    # The count is scaled as a tensor (float32 arithmetic), as mergekit does; int() truncates.
    keep = int(torch.count_nonzero(variance) * fraction)
    if keep == 0:
        return torch.zeros_like(variance, dtype=dtype)
    # Variances are compared in their own dtype (the keys of a half type widen exactly), as topk compares them.
    return rank_window(magnitude_keys(variance.abs()), 0, keep, descending=True).to(dtype)


def energy_weights(task_vectors: torch.Tensor) -> torch.Tensor:
    """Return each model's mean squared task-vector entry, normalised to sum to 1 (uniform when all ≈ 0)."""
    energy = task_vectors.square().reshape(task_vectors.shape[0], -1).mean(dim=1)
    total = torch.sum(energy).item()
    if abs(total) < 1e-6:
        return torch.ones_like(energy) / energy.shape[0]
    return energy / total


def sce(ctx: MergeContext) -> torch.Tensor:
    """Return B + Σᵢ eᵢ·mᵢ·δᵢ / max(Σᵢ eᵢ·mᵢ, 1e-6), in the inputs' dtype.

    δᵢ are the task vectors restricted to the top ``select_topk`` fraction of positions by variance (all
    positions when ``select_topk ≥ 1``), eᵢ their :func:`energy_weights`, and mᵢ the TIES sign-agreement mask.
    There is no per-model weight. Equal variances straddling the ``select_topk`` cut are selected lowest index
    first (:func:`variance_mask`), the one deliberate difference from mergekit. Without non-base inputs the
    result is a copy of the base; raises
    ``ValueError`` without a base.
    """
    base = ctx.base
    others = ctx.others()
    if not others or base.numel() == 0:
        return base.clone()
    int8 = bool(ctx.params.get("int8_mask", False))
    fraction = float(ctx.params.get("select_topk", 1.0))
    task_vectors = torch.stack([ctx.tensors[i] - base for i in others], dim=0)
    if fraction < 1:
        selected = variance_mask(task_vectors, fraction, torch.int8 if int8 else base.dtype)
        task_vectors = task_vectors * selected

    agree = sign_consensus_mask(task_vectors, int8=int8)
    energy = energy_weights(task_vectors)
    energy = energy.reshape((energy.shape[0],) + (1,) * (task_vectors.dim() - 1))
    kept = energy * agree
    merged = (task_vectors * kept).sum(dim=0)
    return base + merged / torch.sum(kept, dim=0).clamp(min=1e-6)


SPEC = register(
    MethodSpec(
        name="sce",
        fn=sce,
        params=(
            ParamSpec("int8_mask", Scope.GLOBAL, bool, default=False),
            ParamSpec("select_topk", Scope.GLOBAL, float, default=1.0, minimum=0.0, maximum=1.0),
        ),
        base=BasePolicy.REQUIRED,
        min_inputs=1,
        reference="https://arxiv.org/abs/2408.07990",
    )
)

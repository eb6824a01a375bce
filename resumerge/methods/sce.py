"""``sce``: Select high-variance positions, Calculate weights from task-vector energy, Erase sign conflicts.

Reference: https://arxiv.org/abs/2408.07990 (FuseChat 2.0).
"""

from __future__ import annotations

import torch

from resumerge.methods.consensus import sign_consensus_weights
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
    variance = population_variance(task_vectors)
    # The count is scaled as a tensor (float32 arithmetic), as mergekit does; int() truncates.
    keep = int(torch.count_nonzero(variance) * fraction)
    if keep == 0:
        return torch.zeros_like(variance, dtype=dtype)
    # Variances are compared in their own dtype (the keys of a half type widen exactly), as topk compares them.
    return rank_window(magnitude_keys(variance.abs()), 0, keep, descending=True).to(dtype)


# Positions per block of population_variance: five float64 buffers of this length stay in a core's L2 cache.
_VARIANCE_BLOCK = 1 << 14


def population_variance(stacked: torch.Tensor) -> torch.Tensor:
    """Return ``torch.var(stacked, dim=0, unbiased=False)``, an order of magnitude faster on the CPU.

    torch reduces over dim 0 with a scalar Welford loop in float64 (for every float dtype) and rounds the result
    to ``stacked``'s dtype. The same float64 Welford steps, run as vectorised elementwise operations over
    cache-sized blocks of positions, give the same numbers: every step is one IEEE operation in the same order.
    The one exception is the sign of a NaN result (which operand's NaN an operation passes on is a detail of
    each kernel); :func:`variance_mask` ranks ``abs()`` and never sees it. On other devices torch.var is used.
    """
    if stacked.device.type != "cpu" or stacked.dim() < 1 or stacked.shape[0] == 0 or stacked.numel() == 0:
        return torch.var(stacked, dim=0, unbiased=False)
    count = stacked.shape[0]
    flat = stacked.reshape(count, -1)
    positions = flat.shape[1]
    out = torch.empty(positions, dtype=stacked.dtype)
    buffers = torch.empty(5, min(positions, _VARIANCE_BLOCK), dtype=torch.float64)
    for start in range(0, positions, _VARIANCE_BLOCK):
        stop = min(positions, start + _VARIANCE_BLOCK)
        mean, m2, value, delta, step = (buffer[: stop - start] for buffer in buffers)
        mean.zero_()
        m2.zero_()
        for seen in range(1, count + 1):
            # delta = x − mean; mean += delta / n; m2 += delta · (x − mean): torch's Welford update.
            value.copy_(flat[seen - 1, start:stop])
            torch.sub(value, mean, out=delta)
            mean.add_(torch.div(delta, seen, out=step))
            m2.add_(torch.sub(value, mean, out=step).mul_(delta))
        out[start:stop].copy_(m2.div_(count))
    if out.dtype == torch.bfloat16:
        # torch rounds a float64 NaN to bfloat16's canonical NaN; a vectorised conversion keeps its payload.
        out.masked_fill_(out.isnan(), float("nan"))
    return out.reshape(stacked.shape[1:])


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
    # Every step below is mergekit's, in the same order and dtype; only the temporaries are gone (products are
    # taken in place, the sign mask is built as numbers, base + merged is taken as merged + base).
    task_vectors = base.new_empty((len(others), *base.shape))
    for slot, index in enumerate(others):
        torch.sub(ctx.tensors[index], base, out=task_vectors[slot])
    if fraction < 1:
        task_vectors.mul_(variance_mask(task_vectors, fraction, torch.int8 if int8 else base.dtype))

    energy = energy_weights(task_vectors)
    kept = sign_consensus_weights(task_vectors).mul_(energy.reshape((energy.shape[0],) + (1,) * base.dim()))
    merged = task_vectors.mul_(kept).sum(dim=0)
    del task_vectors
    return merged.div_(torch.sum(kept, dim=0).clamp_(min=1e-6)).add_(base)

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

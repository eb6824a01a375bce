"""SCE's steps: the variance selection, the energy weights and the per-position tail, which its one definition
(:mod:`resumerge.merge.methods.sce_stream`) runs over one chunk or over several."""

from __future__ import annotations

from collections.abc import Sequence

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.consensus import sign_consensus_weights
from resumerge.merge.methods.ranking import magnitude_keys
from resumerge.merge.methods.rankstream import StreamedWindow
from resumerge.merge.methods.spec import MergeContext
from resumerge.merge.methods.summation import OrderedSum


def stacked_task_vectors(ctx: MergeContext) -> torch.Tensor:
    """The task vectors (each non-base input minus the base) stacked along dim 0, in the base's dtype."""
    base = ctx.base
    others = ctx.others()
    stacked = base.new_empty((len(others), *base.shape))
    for slot, index in enumerate(others):
        torch.sub(ctx.tensors[index], base, out=stacked[slot])
    return stacked


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
    keep = variance_count(int(torch.count_nonzero(variance)), fraction)
    if keep == 0:
        return torch.zeros_like(variance, dtype=dtype)
    # Variances are compared in their own dtype (the keys of a half type widen exactly), as topk compares them.
    window = StreamedWindow(variance.numel(), 0, keep, descending=True, whole=True)
    return window.mask(magnitude_keys(variance.abs()), dtype)


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


def variance_count(nonzero: int, fraction: float) -> int:
    """How many positions the ``select_topk`` window keeps, of ``nonzero`` positions of nonzero variance: the
    count scaled as a tensor (float32 arithmetic) and truncated, as mergekit does."""
    return int(torch.tensor(nonzero, dtype=torch.int64) * fraction)


def energy_weights(task_vectors: torch.Tensor) -> torch.Tensor:
    """Return each model's mean squared task-vector entry, normalised to sum to 1 (uniform when all ≈ 0).

    The squares are summed in :class:`~resumerge.merge.methods.summation.OrderedSum`'s fixed order, so the weights are
    the same for any thread count and when the stream sums them chunk by chunk; it is the order of
    ``torch.mean(dim=1)`` on one CPU thread (what mergekit computes there).
    """
    sums = []
    for vector in task_vectors:
        summer = OrderedSum(vector.numel(), vector.dtype, vector.device)
        summer.add(vector.square())  # one task vector's squares at a time, not the whole stack's
        sums.append(summer)
    return normalised_energy(sums, task_vectors[0].numel(), task_vectors.dtype)


def normalised_energy(sums: Sequence[OrderedSum], count: int, dtype: torch.dtype) -> torch.Tensor:
    """The energy weights from each model's sum of ``count`` squares: divided as ``torch.mean`` divides (in the
    accumulator's dtype, then rounded to ``dtype``), normalised by their sum unless it is ≈ 0 (then uniform)."""
    energy = torch.stack([summer.wide_result() for summer in sums]).div_(count).to(dtype)
    total = torch.sum(energy).item()
    if abs(total) < 1e-6:
        return torch.ones_like(energy) / energy.shape[0]
    return energy / total


def agreement_sum(task_vectors: torch.Tensor, energy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σᵢ eᵢ·mᵢ·δᵢ over the selected task vectors (stacked along dim 0, overwritten) and the weights eᵢ·mᵢ, mᵢ the
    TIES sign-agreement mask: the first of SCE's per-position steps. The caller drops the stack before
    :func:`agreement_mean`, as it is not needed there."""
    shape = (energy.shape[0],) + (1,) * (task_vectors.dim() - 1)
    kept = sign_consensus_weights(task_vectors).mul_(energy.reshape(shape))
    return task_vectors.mul_(kept).sum(dim=0), kept


def agreement_mean(merged: torch.Tensor, kept: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """B + Σᵢ eᵢ·mᵢ·δᵢ / max(Σᵢ eᵢ·mᵢ, 1e-6), in ``merged`` (taken as merged + base, as the products commute)."""
    return merged.div_(torch.sum(kept, dim=0).clamp_(min=1e-6)).add_(base)

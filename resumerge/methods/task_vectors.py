"""The per-position core of the task-arithmetic family: task vectors in, weighted (and elected) sum out.

Everything here after a task vector's sparsification is a function of one position across the inputs, so the
whole-tensor merge (:mod:`resumerge.methods.task_arithmetic`) and its row-chunk form
(:mod:`resumerge.methods.task_stream`) share this code and with it every rounding step: a chunk's result is the
corresponding rows of the whole tensor's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from resumerge.methods.consensus import sign_consensus_weights
from resumerge.methods.spec import MergeContext

DEFAULT_DENSITY = 1.0
DEFAULT_GAMMA = 0.01
DEFAULT_EPSILON = 0.15

# (input index, its task vector) -> the sparsified task vector. The task vector handed over is the caller's own
# buffer: the function may overwrite it and return it.
SparsifyOne = Callable[[int, Tensor], Tensor]


def combine_task_vectors(
    ctx: MergeContext, sparsify_one: SparsifyOne | None, *, consensus: bool, normalize: bool
) -> Tensor:
    """Return B + λ·Σ wᵢ·mᵢ·sparsify_one(i, δᵢ) / D in the base's dtype, δᵢ = θᵢ − B (see
    :func:`resumerge.methods.task_arithmetic.merge_task_vectors` for ``mᵢ`` and ``D``; ``normalize`` is the
    method's default, overridden by ``ctx.params``). Without non-base inputs the result is a copy of the base;
    raises ``ValueError`` without a base."""
    base = ctx.base
    others = ctx.others()
    if not others:
        return base.clone()
    deltas = base.new_empty((len(others), *base.shape))
    for slot, index in enumerate(others):
        # Each task vector is computed, sparsified and weighted in its own slot: no full-size temporaries.
        delta = torch.sub(ctx.tensors[index], base, out=deltas[slot])
        if sparsify_one is not None:
            sparse = sparsify_one(index, delta)
            if sparse.data_ptr() != delta.data_ptr():  # not already written in place (possibly as a view)
                delta.copy_(sparse.reshape(delta.shape))
            del sparse
        del delta  # a view: it would keep every task vector alive until the end
    # Weights are rounded to the inputs' dtype before use, exactly as mergekit builds its weight tensor.
    weights = torch.tensor(
        [float(ctx.model_params[i]["weight"]) for i in others], dtype=deltas.dtype, device=deltas.device
    ).reshape((len(others),) + (1,) * base.dim())
    deltas.mul_(weights)

    if consensus:
        # A 1/0 mask of the deltas' dtype multiplies exactly like mergekit's bool mask (kept values unchanged,
        # dropped ones ±0 by their sign) and much faster; both products are taken in place.
        mask = sign_consensus_weights(deltas)
        mixed = deltas.mul_(mask).sum(dim=0)
        del deltas  # freed before the divisor is summed: one tensor of task vectors less at the peak
        divisor = mask.mul_(weights).sum(dim=0)
        # A zero divisor becomes 1: adding 1 where it is ±0 and 0 elsewhere (exact, NaN stays NaN) is two fast
        # float passes into the dead mask's memory, where masked_fill_ over a bool mask is three times slower.
        divisor.add_(torch.eq(divisor, 0, out=mask[0]))
        del mask
    else:
        mixed = deltas.sum(dim=0)
        divisor = weights.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
        del deltas

    if ctx.params.get("normalize", normalize):
        mixed /= divisor
    scale = float(ctx.params.get("lambda", 1.0))
    if scale != 1:
        mixed *= scale
    # mixed + base is base + mixed bit for bit (IEEE addition commutes), without a new tensor.
    return mixed.add_(base) if mixed.dtype == base.dtype else (base + mixed).to(base.dtype)

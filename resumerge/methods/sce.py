"""``sce``: Select high-variance positions, Calculate weights from task-vector energy, Erase sign conflicts.

Reference: https://arxiv.org/abs/2408.07990 (FuseChat 2.0).
"""

from __future__ import annotations

from resumerge.methods.footprint import block_scratch, measured
from resumerge.methods.sce_steps import (
    _VARIANCE_BLOCK,
    agreement_mean,
    agreement_sum,
    energy_weights,
    stacked_task_vectors,
    variance_mask,
)
from resumerge.methods.sce_stream import sce_stream
from resumerge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope
from resumerge.torch_import import torch


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
    if not ctx.others() or base.numel() == 0:
        return base.clone()
    int8 = bool(ctx.params["int8_mask"])
    fraction = float(ctx.params["select_topk"])
    # Every step below is mergekit's, in the same order and dtype; only the temporaries are gone (products are
    # taken in place, the sign mask is built as numbers, base + merged is taken as merged + base).
    task_vectors = stacked_task_vectors(ctx)
    if fraction < 1:
        task_vectors.mul_(variance_mask(task_vectors, fraction, torch.int8 if int8 else base.dtype))
    merged, kept = agreement_sum(task_vectors, energy_weights(task_vectors))
    del task_vectors  # a stack of tensor-sizes, not needed for the division
    return agreement_mean(merged, kept, base)


SPEC = MethodSpec(
    name="sce",
    title="SCE",
    summary=(
        "select the task-vector entries that vary most across models, weight each model by its "
        "energy, and erase sign conflicts."
    ),
    reference="https://arxiv.org/abs/2408.07990",
    fn=sce,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured(
        (-4, 8, 40, 0, None, (0.25, 4)),
        (-8, 8, 40, 0, None, (1, 2)),
        (-8, 8, 40, 0, None, (0, 2)),
        (-8, 16, 39.75, 0, None, (0.25, 8)),
        scratch=block_scratch(_VARIANCE_BLOCK),
    ),
    params=(
        ParamSpec("int8_mask", Scope.GLOBAL, bool, default=False),
        ParamSpec("select_topk", Scope.GLOBAL, float, default=1.0, minimum=0.0, maximum=1.0),
    ),
    base=BasePolicy.REQUIRED,
    min_inputs=1,
    streamed=sce_stream,
)

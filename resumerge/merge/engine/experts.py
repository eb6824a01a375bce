"""A fused expert stack merged one expert's projection at a time (see :mod:`resumerge.merge.plan.experts`).

Each expert's rows are read on their own (one expert's inputs in memory at a time, besides the result), and each of
its projections (gate and up of a ``gate_up_proj``) is handed to the method as the tensor it would be in a
checkpoint storing experts one by one; the results fill the stack's output in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.spec import MergeContext, MergeFn
from resumerge.merge.plan.merge_plan import ExpertStack, TensorPlan
from resumerge.merge.plan.workunits import chunk_plan


def merge_by_expert(tp: TensorPlan, load: Callable[[TensorPlan], MergeContext], fn: MergeFn) -> torch.Tensor:
    """``fn`` applied to each projection of each expert of ``tp`` (which has :attr:`~TensorPlan.experts`), its
    results assembled into ``tp``'s whole result. ``load`` reads the context of a row chunk of ``tp``: each
    expert's is loaded under the name ``NAME[e]``, so a randomised method draws from a generator of that
    expert's own, whatever order the experts run in."""
    stack = tp.experts
    if stack is None:
        raise ValueError(f"{tp.name} is not a stack of experts")
    out: torch.Tensor | None = None
    for e in range(stack.count):
        ctx = load(replace(chunk_plan(tp, e, e + 1), name=f"{tp.name}[{e}]"))
        expert = [t[0] for t in ctx.tensors]
        for p in range(stack.parts):
            result = fn(replace(ctx, tensors=[_part(t, stack, p).contiguous() for t in expert], owned_inputs=False,
                                read_rows=None))
            if out is None:
                out = result.new_empty(tp.shape)
            _part(out[e], stack, p).copy_(result)
    assert out is not None  # a stack has at least one expert
    return out


def _part(expert: torch.Tensor, stack: ExpertStack, p: int) -> torch.Tensor:
    """Projection ``p`` of one expert's slice ``expert``: a view (strided when the projections interleave)."""
    if stack.parts == 1:
        return expert
    if stack.interleaved:
        index: list[slice] = [slice(None)] * expert.dim()
        index[stack.axis] = slice(p, None, stack.parts)
        return expert[tuple(index)]
    return expert.chunk(stack.parts, dim=stack.axis)[p]

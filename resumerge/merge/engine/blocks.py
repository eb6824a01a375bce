"""A table packed per layer, cut for a new stack of layers, merged one output layer's block at a time (see
:mod:`resumerge.merge.plan.layerblocks`).

The tensor's inputs (each model's whole table, or a row chunk of it when the blocks lie along the columns) are read
once; each output block hands the method the source block of each of its inputs, with the base and parameters of
the slice that made that layer, and the result fills the block's place in the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.spec import MergeContext, MergeFn
from resumerge.merge.plan.merge_plan import TensorPlan


def merge_by_block(tp: TensorPlan, ctx: MergeContext, fn: MergeFn,
                   generator_of: Callable[[str], torch.Generator | None]) -> torch.Tensor:
    """``fn`` applied to each output block of ``tp`` (which has :attr:`~TensorPlan.blocks`) over ``ctx``'s inputs
    (``tp``'s, whole or a row chunk), assembled into ``tp``'s result. A randomised method draws each block from
    ``generator_of(NAME[i])``, a generator of that block's own."""
    packed = tp.blocks
    if packed is None:
        raise ValueError(f"{tp.name} is not a table packed per layer")
    axis, width = packed.axis, packed.width
    out: torch.Tensor | None = None
    for i, layer in enumerate(packed.layers):
        tensors = [ctx.tensors[j].narrow(axis, b * width, width).contiguous()
                   for j, b in zip(layer.inputs, layer.blocks, strict=True)]
        result = fn(replace(ctx, tensors=tensors, base_index=layer.base_index,
                            model_params=[dict(p) for p in layer.model_params], params=dict(layer.params),
                            generator=generator_of(f"{tp.name}[{i}]") if ctx.generator is not None else None,
                            owned_inputs=False, read_rows=None, lend=None))
        if out is None:
            out = result.new_empty(tp.shape)
        out.narrow(axis, i * width, width).copy_(result)
    assert out is not None  # a stack has a layer
    return out

"""``passthrough``: copy one input tensor, optionally scaled (frankenmerges, layer stacking)."""

from __future__ import annotations

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope


def passthrough(ctx: MergeContext) -> torch.Tensor:
    """Return the single input, multiplied by its ``scale`` parameter when one is set.

    The result never aliases the input (a layer used twice must not share storage in the output).
    """
    (tensor,) = ctx.tensors
    scale = ctx.model_params[0]["scale"]
    if scale is None:
        return tensor.clone()
    return tensor * float(scale)


SPEC = MethodSpec(
    name="passthrough",
    title="Passthrough",
    summary=(
        "tensors copied unchanged (optionally scaled) from the listed layers, e.g. to stack layers of"
        " one or more models."
    ),
    fn=passthrough,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((4, 0), (2, 0), (2, 0), (8, 0)),
    params=(ParamSpec("scale", Scope.PER_MODEL, float, default=None),),
    base=BasePolicy.IGNORED,
    min_inputs=1,
    max_inputs=1,
    elementwise=True,
)

"""``passthrough``: copy one input tensor, optionally scaled (frankenmerges, layer stacking)."""

from __future__ import annotations

import torch

from resumerge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, register


def passthrough(ctx: MergeContext) -> torch.Tensor:
    """Return the single input, multiplied by its ``scale`` parameter when one is set.

    The result never aliases the input (a layer used twice must not share storage in the output).
    """
    (tensor,) = ctx.tensors
    scale = ctx.model_params[0].get("scale")
    if scale is None:
        return tensor.clone()
    return tensor * float(scale)


SPEC = register(
    MethodSpec(
        name="passthrough",
        fn=passthrough,
        params=(ParamSpec("scale", Scope.PER_MODEL, float, default=None),),
        base=BasePolicy.IGNORED,
        min_inputs=1,
        max_inputs=1,
        elementwise=True,
    )
)

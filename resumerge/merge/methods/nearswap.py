"""``nearswap``: take the other model's value where it is close to the base, keep the base elsewhere.

Reference: https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001
"""

from __future__ import annotations

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    Scope,
)


def nearswap(ctx: MergeContext) -> torch.Tensor:
    """Return w·θ + (1−w)·B with w = clamp(t / max(|B−θ|, 1e-6), 0, 1), element-wise, in the inputs' dtype.

    Positions where the models differ by at most ``t`` take θ; farther ones blend toward B in proportion to
    t/|B−θ|. Raises ``ValueError`` unless there is a base and exactly one other input.
    """
    others = ctx.others()
    if len(others) != 1:
        raise ValueError(f"nearswap needs a base and exactly one other input, got {len(ctx.tensors)} inputs")
    base = ctx.base
    other = ctx.tensors[others[0]]
    distance = torch.abs(base - other).clamp(min=1e-6)
    weight = (float(ctx.params["t"]) / distance).clamp(min=0, max=1)
    return weight * other + (1 - weight) * base


SPEC = MethodSpec(
    name="nearswap",
    title="Nearswap",
    summary="the base's parameters, swapped towards the other model's where the two are close.",
    reference="https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001",
    fn=nearswap,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((20, 0), (10, 0), (10, 0), (40, 0)),
    params=(ParamSpec("t", Scope.GLOBAL, float, required=True),),
    base=BasePolicy.REQUIRED,
    min_inputs=2,
    max_inputs=2,
    elementwise=True,
)

"""``nuslerp``: slerp between two weighted models, optionally of their task vectors and optionally per row."""

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

_UNIT_EPS = 1e-7  # floor on the norm when computing directions
_COLLINEAR_EPS = 1e-8  # lerp where 1 − cos²Ω ≤ this squared


def nuslerp_tensors(t: float, v0: torch.Tensor, v1: torch.Tensor, *, flatten: bool, row_wise: bool) -> torch.Tensor:
    """Slerp from ``v0`` (t = 0) to ``v1`` (t = 1), in the inputs' dtype.

    With ``flatten`` the tensors are one vector each; otherwise there is one slerp per vector along the last
    dimension, or along dim 0 with ``row_wise`` (i.e. per column of a matrix). Vectors whose directions are
    collinear (1 − cos²Ω ≤ 1e-16) are lerped instead.
    """
    shape = v0.shape
    transposed = not flatten and row_wise
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif transposed:
        v0, v1 = v0.transpose(0, -1), v1.transpose(0, -1)

    u0 = v0 / torch.norm(v0, dim=-1, keepdim=True).clamp(min=_UNIT_EPS)
    u1 = v1 / torch.norm(v1, dim=-1, keepdim=True).clamp(min=_UNIT_EPS)
    cos_theta = torch.sum(u0 * u1, dim=-1, keepdim=True).clamp(-1, 1)
    collinear = (1 - cos_theta.square()) <= _COLLINEAR_EPS**2
    # acos(0) on the collinear branch keeps the unselected spherical formula finite.
    theta = torch.acos(torch.where(collinear, 0, cos_theta))
    spherical = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.sin(theta)
    result = torch.where(collinear, (1 - t) * v0 + t * v1, spherical)
    if transposed:
        result = result.transpose(0, -1)
    return result.reshape(shape)


def nuslerp(ctx: MergeContext) -> torch.Tensor:
    """Merge exactly two non-base inputs at t = w₂/(w₁+w₂) (0.5 when |w₁+w₂| < 1e-6).

    With a base the slerp runs on the task vectors and the base is added back: B + slerp(θ₁−B, θ₂−B).
    Computes in the inputs' dtype. Raises ``ValueError`` unless there are exactly two non-base inputs.
    """
    others = ctx.others()
    if len(others) != 2:
        raise ValueError(f"nuslerp needs exactly two non-base inputs, got {len(others)}")
    first, second = (ctx.tensors[i] for i in others)
    w_first, w_second = (float(ctx.model_params[i]["weight"]) for i in others)
    total = w_first + w_second
    t = 0.5 if abs(total) < 1e-6 else w_second / total
    flatten = bool(ctx.params["nuslerp_flatten"])
    row_wise = bool(ctx.params["nuslerp_row_wise"])
    if ctx.base_index is None:
        return nuslerp_tensors(t, first, second, flatten=flatten, row_wise=row_wise)
    base = ctx.base
    return base + nuslerp_tensors(t, first - base, second - base, flatten=flatten, row_wise=row_wise)


SPEC = MethodSpec(
    name="nuslerp",
    title="NuSLERP",
    summary=(
        "spherical interpolation of two models (or of their task vectors from a base) with weights "
        "instead of a single t."
    ),
    thread_dependent=True,  # a whole-tensor sum: torch splits it over its threads
    fn=nuslerp,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((8, 8), (4, 4), (4, 4), (16, 16.25)),
    params=(
        ParamSpec("weight", Scope.NON_BASE, float, required=True),
        ParamSpec("nuslerp_row_wise", Scope.GLOBAL, bool, default=False),
        ParamSpec("nuslerp_flatten", Scope.GLOBAL, bool, default=True),
    ),
    base=BasePolicy.OPTIONAL,
    min_inputs=2,
    max_inputs=3,
    min_non_base=2,
    max_non_base=2,
)

"""``slerp``: spherical linear interpolation from the base to one other model, each tensor as one vector.

Reference: https://en.wikipedia.org/wiki/Slerp (as used for LLMs by mergekit).
"""

from __future__ import annotations

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import block_scratch, measured
from resumerge.merge.methods.spec import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    Scope,
)

# mergekit 0.1.5 walks the flattened tensor in chunks of this many elements, accumulating norms as norms of
# per-chunk norms and the dot product as a sum of per-chunk sums. We keep the same chunk boundaries both to
# bound the float32 scratch memory and because the float32 result depends on that summation order.
_CHUNK_ELEMENTS = 1024 * 1024
_DOT_THRESHOLD = 0.9995
_NORM_EPS = 1e-8


def slerp_tensors(t: float, v0: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """Interpolate from ``v0`` (t = 0) to ``v1`` (t = 1) along the great circle through their directions.

    Both tensors are treated as single vectors. Norms at or below 1e-8 count as 1; when the directions are
    nearly collinear (|cos Ω| > 0.9995) the result is the plain lerp (1−t)·v0 + t·v1. Otherwise it is
    sin((1−t)Ω)/sin Ω · v0 + sin(tΩ)/sin Ω · v1 on the raw (unnormalised) tensors. The math runs in float32
    (float64 for float64 inputs) and the result has v0's dtype. t = 0 and t = 1 return the ends exactly.
    """
    work = torch.float64 if v0.dtype == torch.float64 else torch.float32
    a = v0.reshape(1, -1)
    b = v1.reshape(1, -1)
    if a.shape[1] == 0:
        return torch.empty_like(v0)
    t_ = torch.tensor([[t]], dtype=work, device=v0.device)
    starts = range(0, a.shape[1], _CHUNK_ELEMENTS)

    def chunk(x: torch.Tensor, start: int) -> torch.Tensor:
        return x[:, start : start + _CHUNK_ELEMENTS].to(work)

    norm_a = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(chunk(a, s), dim=1, keepdim=True) for s in starts]), dim=0
    )
    norm_b = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(chunk(b, s), dim=1, keepdim=True) for s in starts]), dim=0
    )
    norm_a = torch.where(norm_a > _NORM_EPS, norm_a, 1)
    norm_b = torch.where(norm_b > _NORM_EPS, norm_b, 1)
    # Normalising before multiplying keeps the dot product from overflowing for large tensors.
    parts = [(chunk(a, s) / norm_a * (chunk(b, s) / norm_b)).sum(dim=1, keepdim=True) for s in starts]
    dot = torch.stack(parts).sum(dim=0).clamp(-1, 1)
    collinear = dot.abs() > _DOT_THRESHOLD
    # acos(0) on the collinear branch keeps sin Ω away from 0 even where that branch is not selected.
    theta = torch.acos(torch.where(collinear, 0, dot))
    sin_theta = torch.sin(theta)
    coef_a = torch.where(collinear, 1 - t_, torch.sin((1 - t_) * theta) / sin_theta)
    coef_b = torch.where(collinear, t_, torch.sin(t_ * theta) / sin_theta)

    result = torch.empty_like(a)
    for s in starts:
        result[:, s : s + _CHUNK_ELEMENTS] = coef_a * chunk(a, s) + coef_b * chunk(b, s)
    return result.reshape(v0.shape)


def slerp(ctx: MergeContext) -> torch.Tensor:
    """Return :func:`slerp_tensors` from the base to the other input at the global ``t``.

    Raises ``ValueError`` unless there is a base and exactly one other input.
    """
    others = ctx.others()
    if len(others) != 1:
        raise ValueError(f"slerp needs a base and exactly one other input, got {len(ctx.tensors)} inputs")
    return slerp_tensors(float(ctx.params["t"]), ctx.base, ctx.tensors[others[0]])


SPEC = MethodSpec(
    name="slerp",
    title="SLERP",
    summary=(
        "spherical linear interpolation between two models, from the base (t = 0) to the other model "
        "(t = 1)."
    ),
    reference="https://en.wikipedia.org/wiki/Slerp",
    thread_dependent=True,  # a whole-tensor sum: torch splits it over its threads
    fn=slerp,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((4, 0, 12, 0), (2, 0, 12, 0), (2, 0, 12, 0), (8, 0, 24, 0),
                       scratch=block_scratch(_CHUNK_ELEMENTS)),
    params=(ParamSpec("t", Scope.GLOBAL, float, required=True),),
    base=BasePolicy.REQUIRED,
    min_inputs=2,
    max_inputs=2,
)

"""``multislerp``: weighted barycentric interpolation of any number of models on the hypersphere.

Reference: https://goddard.blog/posts/multislerp-wow-what-a-cool-idea
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope


def multislerp(ctx: MergeContext) -> torch.Tensor:
    """Return the weighted spherical mean of the non-base inputs (of their task vectors when there is a base).

    Each flattened input (minus the base) gets a unit direction uᵢ = θᵢ/(‖θᵢ‖+eps); m is the normalised
    weighted mean direction; the weighted tangent vectors T = Σwᵢ(uᵢ − (uᵢ·m)m) are mapped back with the
    exponential map and scaled by Σwᵢ‖θᵢ‖, then the base is added back. Weights are normalised to sum to 1
    unless ``normalize_weights`` is false. A single non-base input is returned as is (the base is then
    unused). Computes in the inputs' dtype.

    When every input equals the base (all task vectors zero) the result is the base. Raises ``ValueError``
    when the weighted mean direction vanishes otherwise (antipodal inputs with balancing weights) and there
    are more than two inputs; with exactly two it falls back to the weighted sum.

    Differs from mergekit 0.1.5 only where mergekit fails: it raises for all-zero task vectors with three or
    more models (any tensor no fine-tune changed), and in float16, where eps = 1e-8 rounds to 0, it returns
    NaN for zero task vectors and for inputs sharing one direction (0/0).
    """
    others = ctx.others()
    if not others:
        raise ValueError("multislerp needs at least one non-base input")
    if len(others) == 1 or ctx.tensors[0].numel() == 0:
        return ctx.tensors[others[0]].clone()
    eps = float(ctx.params["eps"])
    base = ctx.base if ctx.base_index is not None else None

    stacked = torch.stack([ctx.tensors[i] for i in others], dim=0)
    if base is not None:
        stacked -= base
    flat = stacked.view(stacked.shape[0], -1)
    weights = torch.tensor(
        [float(ctx.model_params[i]["weight"]) for i in others], dtype=stacked.dtype, device=stacked.device
    )
    if ctx.params["normalize_weights"]:
        weights = weights / weights.sum()

    norms = torch.norm(flat, dim=-1, keepdim=True)
    if not bool(norms.any()):
        return base.clone() if base is not None else torch.zeros_like(ctx.tensors[others[0]])
    # A zero vector gets a zero direction; the where only matters in float16, where norm + eps can be 0.
    padded = norms + eps
    units = flat / torch.where(padded == 0, 1, padded)
    mean = (units * weights.view(-1, 1)).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps or mean_norm == 0:
        if len(others) != 2:
            raise ValueError(
                "multislerp: the weighted mean direction of the inputs is zero (antipodal inputs whose "
                "weights balance out); change the weights."
            )
        fallback = (stacked[0] * weights[0] + stacked[1] * weights[1]).view(stacked.shape[1:])
        return fallback + base if base is not None else fallback
    mean = mean / mean_norm

    tangents = units - (units * mean).sum(-1, keepdim=True) * mean
    tangent = (tangents * weights.view(-1, 1)).sum(0)
    # The eps keeps sin(x)/x finite when all inputs share one direction (tangent = 0), except in float16,
    # where it rounds away; sin(x)/x → 1 there.
    tangent_norm = torch.norm(tangent) + eps
    ratio = torch.where(tangent_norm == 0, 1, torch.sin(tangent_norm) / tangent_norm)
    result = mean * torch.cos(tangent_norm) + tangent * ratio
    scaled: torch.Tensor = (result * (norms.squeeze(-1) * weights).sum()).view(stacked.shape[1:])
    return scaled + base if base is not None else scaled


def check_weight_sum(params: Mapping[str, Any], model_params: Sequence[Mapping[str, Any]]) -> str | None:
    """Reject weights summing to zero under ``normalize_weights`` (mergekit silently writes NaN then)."""
    if not params["normalize_weights"]:
        return None
    weights = [float(p["weight"]) for p in model_params if "weight" in p]
    if len(weights) > 1 and abs(sum(weights)) < 1e-8:
        return (
            "multislerp weights sum to zero, so they cannot be normalised; change them or set normalize_weights: false."
        )
    return None


SPEC = MethodSpec(
    name="multislerp",
    title="Multi-SLERP",
    summary="a weighted spherical average of any number of models, optionally around a base.",
    reference="https://goddard.blog/posts/multislerp-wow-what-a-cool-idea",
    fn=multislerp,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((12, 16, 0, 0, 4), (6, 8, 0, 0, 2), (6, 8, 0, 0, 2), (24, 32, 0, 0, 8), by_models=True),
    params=(
        ParamSpec("weight", Scope.NON_BASE, float, required=True),
        ParamSpec("normalize_weights", Scope.GLOBAL, bool, default=True),
        ParamSpec("eps", Scope.GLOBAL, float, default=1e-8, minimum=0.0),
    ),
    base=BasePolicy.OPTIONAL,
    min_inputs=1,
    min_non_base=1,
    check=check_weight_sum,
)

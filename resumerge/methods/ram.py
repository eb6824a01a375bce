"""``ram`` and ``ramplus_tl``: Reinforced Agent Merging (keep unique updates whole, average shared ones).

Reference: https://arxiv.org/abs/2601.13572
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from resumerge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope, register


class _Touched(NamedTuple):
    deltas: torch.Tensor  # [models, positions], zero where a model did not touch a position
    touched: torch.Tensor  # bool [models, positions]: |δ| > epsilon
    counts: torch.Tensor  # int [1, positions]: how many models touched each position
    shared: torch.Tensor  # bool [1, positions]: touched by more than one model
    unique: torch.Tensor  # bool [1, positions]: touched by exactly one model


def _touched(ctx: MergeContext, epsilon: float) -> _Touched:
    base = ctx.base
    others = ctx.others()
    deltas = torch.stack([ctx.tensors[i] - base for i in others], dim=0).view(len(others), -1)
    touched = deltas.abs() > epsilon
    counts = touched.sum(dim=0, keepdim=True)
    return _Touched(deltas * touched, touched, counts, counts > 1, counts == 1)


def ram(ctx: MergeContext) -> torch.Tensor:
    """Return B + Σᵢ δᵢ·[touched once] + Σᵢ δᵢ·[touched by k > 1]/k, per position, in the inputs' dtype.

    A model touches a position when |δᵢ| > ``epsilon``; untouched entries contribute nothing. Element-wise.
    Without non-base inputs the result is a copy of the base; raises ``ValueError`` without a base.
    """
    base = ctx.base
    if not ctx.others():
        return base.clone()
    t = _touched(ctx, float(ctx.params.get("epsilon", 1e-5)))
    merged = (t.deltas * t.unique + t.deltas * t.shared / t.counts.clamp(min=1)).sum(dim=0, keepdim=True)
    return base + merged.reshape_as(base)


def ramplus_tl(ctx: MergeContext) -> torch.Tensor:
    """Return :func:`ram` with each model's unique updates amplified by λᵢ = 1 + r·clip(ρᵢ, 0, alpha).

    ρᵢ = (positions model i shares with others) / max(positions only model i touched, epsilon), counted over
    the whole tensor ("tensor-local"), so the result is not element-wise. λ is float32, so for half-precision
    inputs the result is float32 (as in mergekit; the engine casts it to the output dtype).
    """
    base = ctx.base
    if not ctx.others():
        return base.clone()
    epsilon = float(ctx.params.get("epsilon", 1e-5))
    r = float(ctx.params.get("r", 0.1))
    alpha = float(ctx.params.get("alpha", 0.2))
    t = _touched(ctx, epsilon)
    shared_count = (t.touched & t.shared).sum(dim=1)
    unique_count = (t.touched & t.unique).sum(dim=1)
    rho = shared_count / unique_count.clamp(min=epsilon)
    amplify = 1 + r * rho.clamp(min=0, max=alpha)
    merged = (t.deltas * t.unique * amplify.unsqueeze(-1) + t.deltas * t.shared / t.counts.clamp(min=1)).sum(
        dim=0, keepdim=True
    )
    return base + merged.reshape_as(base)


SPEC = register(
    MethodSpec(
        name="ram",
        fn=ram,
        params=(ParamSpec("epsilon", Scope.GLOBAL, float, default=1e-5, minimum=0.0),),
        base=BasePolicy.REQUIRED,
        min_inputs=1,
        elementwise=True,
        reference="https://arxiv.org/abs/2601.13572",
    )
)

SPEC_PLUS = register(
    MethodSpec(
        name="ramplus_tl",
        fn=ramplus_tl,
        params=(
            ParamSpec("r", Scope.GLOBAL, float, default=0.1),
            ParamSpec("alpha", Scope.GLOBAL, float, default=0.2, minimum=0.0),
            # Strictly positive: epsilon also floors ρ's denominator, and a model with no touched positions
            # would otherwise get 0/0 = NaN for λ, which poisons every position (NaN·0 is NaN).
            ParamSpec("epsilon", Scope.GLOBAL, float, default=1e-5, minimum=0.0, exclusive_min=True),
        ),
        base=BasePolicy.REQUIRED,
        min_inputs=1,
        reference="https://arxiv.org/abs/2601.13572",
        half_result_float32=True,
    )
)

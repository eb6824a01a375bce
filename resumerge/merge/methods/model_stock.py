"""``model_stock``: interpolate between the base and the average of fine-tuned models by their agreement.

Reference: https://arxiv.org/abs/2403.19522
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


def model_stock(ctx: MergeContext) -> torch.Tensor:
    """Return t·mean(θᵢ) + (1−t)·B with t = N·cos θ / (1 + (N−1)·cos θ), in the inputs' dtype.

    N counts the non-base inputs and cos θ is the mean pairwise cosine of their task vectors: of the whole
    flattened tensor, or per vector along the last dimension with ``filter_wise`` (a 1-D tensor is one
    vector). Where the denominator is within 1e-6 of zero the base is kept (t = 0). Raises ``ValueError``
    without a base or with fewer than two other inputs.
    """
    base = ctx.base
    others = [ctx.tensors[i] for i in ctx.others()]
    if len(others) < 2:
        raise ValueError(f"model_stock needs a base and at least two other inputs, got {len(others)} others")
    shape = base.shape
    if ctx.params["filter_wise"]:
        if base.dim() == 1:
            base = base.unsqueeze(0)
            others = [w.unsqueeze(0) for w in others]
    else:
        base = base.reshape(-1)
        others = [w.reshape(-1) for w in others]

    offsets = [w - base for w in others]
    cosines = []
    for i, first in enumerate(offsets):
        for second in offsets[i + 1 :]:
            norms = torch.norm(first, dim=-1) * torch.norm(second, dim=-1)
            cosines.append(((first * second).sum(dim=-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos_theta = torch.stack(cosines).mean(dim=0).unsqueeze(-1)

    count = len(others)
    denominator = 1 + (count - 1) * cos_theta
    # No finite estimate exists at the singularity; keeping the base beats amplifying opposing updates.
    singular = denominator.abs() < 1e-6
    t = torch.where(
        singular,
        torch.zeros_like(cos_theta),
        count * cos_theta / torch.where(singular, torch.ones_like(denominator), denominator),
    )
    average = sum(others[1:], others[0]) / count
    return (t * average + (1 - t) * base).reshape(shape)


SPEC = MethodSpec(
    name="model_stock",
    title="Model Stock",
    summary=(
        "the average of the fine-tuned models pulled towards the base by a ratio derived from the "
        "angle between their task vectors."
    ),
    reference="https://arxiv.org/abs/2403.19522",
    thread_dependent=True,  # a whole-tensor sum: torch splits it over its threads
    fn=model_stock,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((11.5, 4.25), (6, 2.25), (6, 2.25), (23, 8.5)),
    params=(ParamSpec("filter_wise", Scope.GLOBAL, bool, default=False),),
    base=BasePolicy.REQUIRED,
    min_inputs=3,
)

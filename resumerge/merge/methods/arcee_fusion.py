"""``arcee_fusion``: adopt the other model's value only where its change is unusually important.

Importance = |θ − B| × KL(softmax θ ‖ softmax B) per row; the threshold is median + 1.5·IQR of the importance
scores. Reference: https://arcee.ai (Arcee Fusion, as implemented in mergekit 0.1.5).
"""

from __future__ import annotations

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.ranking import order_statistics
from resumerge.merge.methods.spec import (
    BasePolicy,
    MergeContext,
    MethodSpec,
)

# Quantiles of larger tensors are estimated from this many samples (drawn with replacement), which bounds
# the selection.
QUANTILE_SAMPLE_SIZE = 1_000_000
_SOFTMAX_EPS = 1e-8


def importance(other: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Return |other − base| scaled by the row-wise KL divergence of softmax(other) from softmax(base).

    Softmax runs along the last dimension (a 1-D tensor is one row), in the inputs' dtype.
    """
    p = torch.nn.functional.softmax(other, dim=-1) + _SOFTMAX_EPS
    q = torch.nn.functional.softmax(base, dim=-1) + _SOFTMAX_EPS
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    return (other - base).abs() * kl


def threshold(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Return median + 1.5·(q3 − q1) of ``scores`` as a 0-d tensor of their dtype.

    Quantiles are order statistics at index ⌊q·(n−1)⌋ (q in float32, as mergekit computes it). Above
    :data:`QUANTILE_SAMPLE_SIZE` elements they come from a sample drawn with replacement from ``generator``.
    """
    flat = scores.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE_SIZE:
        picks = torch.randint(flat.numel(), (QUANTILE_SAMPLE_SIZE,), generator=generator, device=flat.device)
        flat = flat[picks]
    positions = (torch.tensor([0.25, 0.5, 0.75]) * (flat.numel() - 1)).long().tolist()
    # Order statistics are values, the same whichever order a sort gives equal scores: a selection finds them
    # exactly, without sorting the sample.
    q1, median, q3 = order_statistics(flat, positions).unbind()
    return median + 1.5 * (q3 - q1)


def arcee_fusion(ctx: MergeContext) -> torch.Tensor:
    """Return B + (θ − B)·[importance ≥ threshold].

    The mask is float32, so half-precision inputs give a float32 result, as in mergekit (the engine casts it).
    Raises ``ValueError`` without a generator (tensors above :data:`QUANTILE_SAMPLE_SIZE` elements sample
    their quantiles; it is required always so that a missing one fails fast) or unless there is a base and
    exactly one other input.
    """
    if ctx.generator is None:
        raise ValueError("arcee_fusion needs an explicit torch.Generator (never the global RNG)")
    others = ctx.others()
    if len(others) != 1:
        raise ValueError(f"arcee_fusion needs a base and exactly one other input, got {len(ctx.tensors)} inputs")
    base = ctx.base
    other = ctx.tensors[others[0]]
    if base.numel() == 0:  # no quantiles exist; the float32 mask would still promote half inputs
        return torch.empty(base.shape, dtype=torch.promote_types(base.dtype, torch.float32), device=base.device)
    scores = importance(other, base)
    mask = (scores >= threshold(scores, ctx.generator)).float()
    return base + (other - base) * mask


SPEC = MethodSpec(
    name="arcee_fusion",
    title="Arcee Fusion",
    summary=(
        "the base, updated only where the other model's change is important (large difference and "
        "divergence)."
    ),
    reference="https://www.arcee.ai",
    fn=arcee_fusion,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((16, 0), (18, 0), (18, 0), (36, 0)),
    base=BasePolicy.REQUIRED,
    min_inputs=2,
    max_inputs=2,
    randomized=True,
    half_result_float32=True,
)

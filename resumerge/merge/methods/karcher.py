"""``karcher``: the Riemannian (Karcher) mean of the inputs' directions on the unit hypersphere.

Reference: https://arxiv.org/abs/2603.04972
"""

from __future__ import annotations

from collections.abc import Sequence
from types import EllipsisType

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope


def directions(tensors: Sequence[torch.Tensor], alphas: Sequence[float],
               tol: float) -> tuple[torch.dtype, list[torch.Tensor], list[float], list[torch.Tensor]]:
    """What the mean starts from: the dtype norms are taken in (float64 for float64 inputs, else float32), every
    input's norm, and for the inputs whose norm is over ``tol`` their share of those inputs' α and their unit
    direction (in the input's dtype)."""
    work = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms = [torch.linalg.vector_norm(x.to(work)) for x in tensors]
    valid = [i for i, n in enumerate(norms) if n.item() > tol]
    total = sum(alphas[i] for i in valid)
    weights = [alphas[i] / total for i in valid]
    points = [torch.zeros_like(tensors[i]) if norms[i].item() == 0.0 else (tensors[i] / norms[i]).to(tensors[i].dtype)
              for i in valid]
    return work, norms, weights, points


def karcher_mean(
    tensors: Sequence[torch.Tensor], alphas: Sequence[float], *, max_iter: int, tol: float
) -> torch.Tensor:
    """Return the weighted Karcher mean of the tensors' unit directions, scaled by Σ αᵢ‖θᵢ‖.

    Inputs with norm ≤ ``tol`` take no part in the direction (their α still counts in the scale); if none is
    left the result is zero. Starting from the normalised weighted average direction, each of at most
    ``max_iter`` steps moves along the mean log-map until the tangent norm drops below ``tol``. Norms are
    taken in float32 (float64 for float64 inputs); the directions and the result keep the inputs' dtype, as
    in mergekit.
    """
    if len(tensors) == 1:
        return tensors[0].clone()
    work, norms, weights, points = directions(tensors, alphas, tol)
    if not points:
        return torch.zeros_like(tensors[0])

    # Every product and sum is written into three reused buffers (the plain expressions allocate four
    # full-size temporaries per input and step), and the per-element work of a step runs one block of positions
    # at a time: the block's slices of the mean, the tangent and the buffer stay in cache while each input is
    # folded in, where whole-tensor passes read them from memory once per input and operation. Each element
    # sees the same operations in the same order, so the numbers are the same (see _scaled); the reductions
    # (dots and norms) still run over the whole tensor.
    buffer = torch.empty_like(points[0])
    mean = torch.zeros_like(points[0])
    for weight, point in zip(weights, points, strict=True):
        mean += torch.mul(point, weight, out=buffer)  # weight * point
    mean_norm = torch.linalg.vector_norm(mean.to(work))
    # A vanishing average direction (e.g. two antipodal inputs) has no normalisation; start from an input.
    if mean_norm.item() < tol:
        mean = points[0].clone()
    else:  # mean / mean_norm
        mean, buffer = torch.div(mean, mean_norm, out=buffer), mean

    tangent = torch.empty_like(mean)
    for _ in range(max_iter):
        terms = []
        for weight, point in zip(weights, points, strict=True):
            dot = torch.clamp(torch.dot(mean.flatten(), point.flatten()), -1.0, 1.0)
            theta = torch.arccos(dot)
            if theta.item() < tol:
                continue  # the log map of a point at the mean is zero (and θ/sin θ is 0/0)
            terms.append((dot, weight * (theta / torch.sin(theta)), point))
        for block in _blocks(mean):
            # Σ weight * (θ / sin θ) * (point − dot * mean), from zero
            part, at, spare = _part(tangent, block), _part(mean, block), _part(buffer, block)
            part.zero_()
            for dot, factor, point in terms:
                log_map = torch.sub(_part(point, block), _scaled(dot, at, out=spare), out=spare)
                part += _scaled(factor, log_map)
        tangent_norm = torch.linalg.vector_norm(tangent.to(work))
        if tangent_norm.item() < tol:
            break
        # cos‖t‖ * mean + sin‖t‖ * (t / ‖t‖) into the buffer; tangent is rebuilt from zero next step, so it
        # holds the second term.
        along, across = torch.sin(tangent_norm), torch.cos(tangent_norm)
        for block in _blocks(mean):
            part = _part(tangent, block)
            part = _scaled(along, torch.div(part, tangent_norm, out=part))
            _scaled(across, _part(mean, block), out=_part(buffer, block)).add_(part)
        mean, buffer = buffer, mean
        unit_norm = torch.linalg.vector_norm(mean.to(work))
        if unit_norm.item() > tol:
            mean, buffer = torch.div(mean, unit_norm, out=buffer), mean

    del buffer, tangent
    scale = sum((a * n for a, n in zip(alphas, norms, strict=True)), torch.zeros((), dtype=work, device=mean.device))
    return _scaled(scale, mean)  # scale * mean, in place: mean is ours (a fresh buffer or a clone)


# Positions per block of a step: the block's mean, tangent and buffer slices (3 × 256 KiB in float32) stay in a
# core's L2 cache while every input is folded in; larger blocks fall out of it, smaller ones pay torch's
# per-call overhead (about 2 µs) too often.
_BLOCK = 1 << 16


def _blocks(tensor: torch.Tensor) -> list[slice] | list[EllipsisType]:
    # A tensor of one block is taken whole, as it is (a 0-d tensor meets 0-d factors differently from a 1-D one:
    # torch promotes two 0-d operands to the wider dtype, so it must not be flattened).
    total = tensor.numel()
    if total <= _BLOCK:
        return [...]
    return [slice(start, min(total, start + _BLOCK)) for start in range(0, total, _BLOCK)]


def _part(tensor: torch.Tensor, block: slice | EllipsisType) -> torch.Tensor:
    # The block's positions of a contiguous tensor (every buffer here is one), as a view.
    return tensor[...] if block is ... else tensor.view(-1)[block]


def _scaled(factor: torch.Tensor, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # factor * tensor (factor 0-d) into `out`, or into `tensor` itself. With equal dtypes the product commutes
    # exactly and is taken in place. A 0-d float32 factor of a half tensor is applied differently as first or
    # second operand, so it stays first; torch then computes into a temporary and copies it out (still one
    # fewer allocation kept alive).
    target = tensor if out is None else out
    if factor.dtype == tensor.dtype:
        return torch.mul(tensor, factor, out=target)
    return torch.mul(factor, tensor, out=target)


def karcher(ctx: MergeContext) -> torch.Tensor:
    """Return the equal-weight :func:`karcher_mean` of every input (a base, if any, is just another input)."""
    count = len(ctx.tensors)
    return karcher_mean(
        ctx.tensors,
        [1.0 / count] * count,
        max_iter=int(ctx.params["max_iter"]),
        tol=float(ctx.params["tol"]),
    )


SPEC = MethodSpec(
    name="karcher",
    title="Karcher mean",
    summary="the Riemannian (Karcher) mean of the models' parameter directions.",
    # The card links the mean itself; the merge method is https://arxiv.org/abs/2603.04972.
    reference="https://en.wikipedia.org/wiki/Karcher_mean",
    thread_dependent=True,  # a whole-tensor sum: torch splits it over its threads
    fn=karcher,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((12, 4), (6.5, 2), (9.5, 2), (24, 8), half_dot=True),
    params=(
        ParamSpec("max_iter", Scope.GLOBAL, int, default=10, minimum=0),
        ParamSpec("tol", Scope.GLOBAL, float, default=1e-5, minimum=0.0),
    ),
    base=BasePolicy.IGNORED,
    # mergekit 0.1.5 declares no minimum beyond one input; a single input is returned unchanged.
    min_inputs=1,
)

"""``linear``: a weighted average of the inputs (Wortsman et al., model soups, arXiv 2203.05482)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import measured
from resumerge.merge.methods.spec import BasePolicy, MergeContext, MethodSpec, ParamSpec, Scope


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # mergekit 0.1.5 accumulates in float32 (float64 for float64 inputs) and casts back to the input dtype.
    return torch.float64 if dtype == torch.float64 else torch.float32


# Elements of the accumulator summed at a time on the CPU: its tile (512 KiB of float32) stays in the core's cache
# through the zeroing, every input's product and the division, where whole-tensor passes took each of them through
# memory (five passes over the output, most of a linear merge's compute). A multiple of every vector loop's step, so
# each element is computed by the same instructions as in one pass over the whole tensor: the same bits.
TILE = 1 << 17


def linear(ctx: MergeContext) -> torch.Tensor:
    """Return Σ wᵢ·θᵢ / Σ wᵢ (or Σ wᵢ·θᵢ without ``normalize``), in the inputs' dtype.

    Accumulates from zero in config order in float32 (float64 for float64 inputs), as mergekit 0.1.5 does.
    Raises ``ValueError`` for non-float tensors.
    """
    first = ctx.tensors[0]
    if not first.is_floating_point():
        raise ValueError(f"linear merge needs floating-point tensors, got {first.dtype}")
    acc_dtype = _accumulation_dtype(first.dtype)
    # Weights become a tensor of the accumulation dtype and are applied with addcmul_, as mergekit 0.1.5 does,
    # so results agree bit for bit rather than within rounding.
    weights = torch.tensor([float(p["weight"]) for p in ctx.model_params], dtype=acc_dtype, device=first.device)
    total = None
    if ctx.params["normalize"]:
        total = weights.sum()
        if abs(float(total)) < 1e-8:
            raise ValueError("linear merge weights sum to zero; set normalize: false or change the weights")
    acc = ctx.result_buffer(tuple(first.shape), acc_dtype, first.device)
    terms = list(zip(ctx.tensors, weights.unbind(0)))
    if acc.numel() > TILE and _tiled(acc, ctx.tensors):  # one tile is summed whole (90k tiny tensors: not asked)
        # Cast into the engine's second lent buffer, tile by tile while the tile is in cache: ``acc.to()`` was a
        # fresh tensor of the result's size each time, its pages faulted in and zeroed by the kernel (a bfloat16
        # merge: half the page faults of the worker). copy_ casts as to() does: the same bits.
        casting = acc_dtype != first.dtype
        out = ctx.result_buffer(tuple(first.shape), first.dtype, first.device, use="cast") if casting else acc
        flat, cast = acc.view(-1), out.view(-1)
        inputs = [(t.view(-1), w) for t, w in terms]
        for start in range(0, flat.numel(), TILE):
            _sum(flat[start : start + TILE], [(t[start : start + TILE], w) for t, w in inputs], total)
            if casting:
                cast[start : start + TILE].copy_(flat[start : start + TILE])
        return out
    _sum(acc, terms, total)
    return acc.to(first.dtype)


def _sum(acc: torch.Tensor, terms: Sequence[tuple[torch.Tensor, torch.Tensor]], total: torch.Tensor | None) -> None:
    """Σ wᵢ·θᵢ (/ ``total``) into ``acc``, from +0 as a fresh zeros is (``acc`` is the engine's reused buffer)."""
    acc.zero_()
    for tensor, weight in terms:
        acc.addcmul_(tensor, weight)
    if total is not None:
        acc.div_(total)


def _tiled(acc: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the sum of an ``acc`` of more than one tile runs tile by tile: on the CPU, with this thread's kernels
    on this thread alone (the engine's whole tensors; a tile's kernels split over torch's threads would wait on each
    other thousands of times a tensor), over inputs shaped as ``acc`` and contiguous (broadcast or strided inputs are
    summed whole)."""
    return (acc.device.type == "cpu" and acc.is_contiguous() and torch.get_num_threads() == 1
            and all(t.shape == acc.shape and t.is_contiguous() and t.device == acc.device for t in tensors))


def _check(params: Mapping[str, Any], model_params: Sequence[Mapping[str, Any]]) -> str | None:
    if params["normalize"] and abs(sum(float(p["weight"]) for p in model_params)) < 1e-8:
        return (
            "linear merge weights sum to zero, so normalize would divide by zero; "
            "change them or set normalize: false"
        )
    return None


SPEC = MethodSpec(
    name="linear",
    title="Linear",
    summary="a weighted average of the models' parameters.",
    reference="https://arxiv.org/abs/2203.05482",
    fn=linear,
    # Working memory measured by bench/method_footprint.py --fit (float32, bfloat16, float16, float64).
    footprint=measured((4, 0), (8, 0), (8, 0), (8, 0)),
    params=(
        ParamSpec("weight", Scope.PER_MODEL, float, required=True),
        ParamSpec("normalize", Scope.GLOBAL, bool, default=True),
    ),
    base=BasePolicy.IGNORED,
    min_inputs=1,
    elementwise=True,
    check=_check,
)

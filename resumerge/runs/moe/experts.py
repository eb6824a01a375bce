"""The expert tensors as registered pure methods: one expert's MLP tensor copied (Qwen MoE and DeepSeek MoE
layouts), or every expert's stacked into transformers' fused pair (Mixtral and Qwen3 MoE), each with its
expert's ``noise_scale`` and ``residual_scale`` applied as mergekit-moe does, in the stored dtype.

Noise is drawn from the tensor's own generator (seeded from the run's seed and the output tensor's name), so a
resumed run draws the same noise; mergekit draws it from one global generator in write order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.footprint import MethodFootprint, measured
from resumerge.merge.methods.spec import MergeContext, MethodSpec, declared

COPY = "moe_expert"
# The same copy where nothing is drawn or scaled (every base tensor, and experts without noise_scale or
# residual_scale): the input cast straight into a new tensor of the output dtype, which is the output buffer.
COPY_PLAIN = "moe_copy"
FUSED = "moe_fused_experts"
# The same stack where no expert of it draws noise or scales its residual: the inputs are cast into the output
# and nothing else is made, so a smaller footprint (under --max-memory 1GB the 1.74 GB bench pair's fused tensors
# fit only with it).
FUSED_COPIES = "moe_fused_copies"
ZEROS = "moe_zeros"
FLOAT_NAMES = ("float32", "bfloat16", "float16", "float64")  # the output dtypes the cast-only methods make
# Not measured by the harness (internal units have no config cases); figured by hand with room to spare, in bytes
# per element for float32, bfloat16, float16, float64. A copy with noise holds the draw, the product and the sum
# (three tensors); a fused expert tensor its output (at most 4 bytes an element: float32 output; float64's 8) and
# one input's noised copy at a time (three tensors of an input's size, at most half the output's elements).
COPY_FOOTPRINT = measured((12, 0), (6, 0), (6, 0), (24, 0))
FUSED_FOOTPRINT = measured((10, 0), (7, 0), (7, 0), (20, 0))
# Plain copies and stacks: the inputs are cast into the output tensor, which the engine writes as it is (already
# in the output dtype and contiguous), so nothing beyond the stored inputs and the output buffer the engine counts
# (measured on the 1.74 GB bench pair: the run's process held about 270 MB over its baseline for a 2 x 11008 x 2048
# bfloat16 stack of float32 inputs, 180 MB of inputs and 90 MB of output; the old figure, 4 bytes an element,
# counted 226 MB more, and a plain copy's three tensors of the noised one 245 MB more for each embedding).
OUTPUT_ONLY_FOOTPRINT = measured((0, 0), (0, 0), (0, 0), (0, 0), in_output=True)
# The routers and zero biases (small tensors): the rule of thumb a method never measured used to get, a
# float64-sized temporary per input and one more.
SMALL_FOOTPRINT: MethodFootprint = measured((8, 8), (8, 8), (8, 8), (8, 8))


def scaled(tensor: torch.Tensor, params: Mapping[str, Any], generator: torch.Generator | None, *,
           copy: bool = True) -> torch.Tensor:
    """``tensor`` with its expert's noise added and, for a ``down_proj``, its residual scale applied; with
    ``copy`` never the input itself (an expert used twice must not share storage in the output)."""
    noise = params.get("noise_scale")
    if noise is not None:
        if generator is None:
            raise ValueError("noise needs an explicit torch.Generator (never the global RNG)")
        drawn = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype, device=tensor.device)
        tensor = tensor + drawn * noise
    residual = params.get("residual_scale")
    if residual is not None:
        tensor = tensor * residual
    return tensor.clone() if copy and noise is None and residual is None else tensor


def expert_copy(ctx: MergeContext) -> torch.Tensor:
    """One expert's MLP tensor (or a base tensor, with no parameters): a copy, noised and scaled."""
    (tensor,) = ctx.tensors
    return scaled(tensor, ctx.model_params[0], ctx.generator)


def plain_copy(ctx: MergeContext) -> torch.Tensor:
    """A tensor copied unchanged in the output dtype ``dtype``: one cast into a new tensor (never the input itself),
    the bits of mergekit-moe's ``.to(dtype)``; the engine writes it as it is."""
    (tensor,) = ctx.tensors
    return tensor.to(getattr(torch, ctx.params["dtype"]), copy=True)


def fused_experts(ctx: MergeContext) -> torch.Tensor:
    """transformers' fused expert tensor of one layer, in the output dtype ``dtype``: ``gate_up`` stacks each
    expert's ``cat([gate, up])`` (the inputs are gate, up of expert 0, then of expert 1, ...), ``down`` stacks each
    expert's ``down_proj``. Each input is noised and scaled first, in input order, then copied into its place:
    casting element by element gives the bits of mergekit's cast of the stacked tensor, without its float32
    stack."""
    per = 2 if ctx.params["part"] == "gate_up" else 1
    first = ctx.tensors[0]
    rows = first.shape[0]
    dtype = getattr(torch, ctx.params["dtype"])
    out = torch.empty((len(ctx.tensors) // per, rows * per, *first.shape[1:]), dtype=dtype,
                      device=first.device)
    for i, (tensor, params) in enumerate(zip(ctx.tensors, ctx.model_params)):
        expert, k = divmod(i, per)
        out[expert, k * rows : (k + 1) * rows] = scaled(tensor, params, ctx.generator, copy=False)
    return out


def zeros(ctx: MergeContext) -> torch.Tensor:
    """Zeros of the planned shape: the attention bias Qwen2-MoE requires when the base has none, a router's
    score correction bias (GLM-4-MoE)."""
    return torch.zeros(tuple(ctx.params["shape"]), dtype=torch.float32)


# The unit functions of this module, which a MoE plan hands the engine (Plan.units).
UNITS = declared(
    MethodSpec(name=COPY, fn=expert_copy, min_inputs=1, max_inputs=1, randomized=True,
               reference="mergekit-moe copy_tensor_out / noise_and_scale", footprint=COPY_FOOTPRINT),
    MethodSpec(name=COPY_PLAIN, fn=plain_copy, min_inputs=1, max_inputs=1,
               reference="mergekit-moe copy_tensor_out", footprint=OUTPUT_ONLY_FOOTPRINT),
    MethodSpec(name=FUSED, fn=fused_experts, min_inputs=1, randomized=True,
               reference="transformers' mixtral / qwen3_moe checkpoint conversion", footprint=FUSED_FOOTPRINT),
    MethodSpec(name=FUSED_COPIES, fn=fused_experts, min_inputs=1,
               reference="transformers' mixtral / qwen3_moe checkpoint conversion",
               footprint=OUTPUT_ONLY_FOOTPRINT),
    MethodSpec(name=ZEROS, fn=zeros, min_inputs=0, max_inputs=0, reference="mergekit-moe qwen.py",
               footprint=SMALL_FOOTPRINT),
)

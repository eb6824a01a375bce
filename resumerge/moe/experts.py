"""The expert tensors as registered pure methods: one expert's MLP tensor copied (Qwen MoE and DeepSeek MoE
layouts), or every expert's stacked into transformers' fused pair (Mixtral and Qwen3 MoE), each with its
expert's ``noise_scale`` and ``residual_scale`` applied as mergekit-moe does, in the stored dtype.

Noise is drawn from the tensor's own generator (seeded from the run's seed and the output tensor's name), so a
resumed run draws the same noise; mergekit draws it from one global generator in write order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from resumerge.methods.spec import MergeContext, MethodSpec, register

COPY = "moe_expert"
FUSED = "moe_fused_experts"
ZEROS = "moe_zeros"


def scaled(tensor: torch.Tensor, params: Mapping[str, Any], generator: torch.Generator | None) -> torch.Tensor:
    """``tensor`` with its expert's noise added and, for a ``down_proj``, its residual scale applied; never the
    input itself (an expert used twice must not share storage in the output)."""
    noise = params.get("noise_scale")
    if noise is not None:
        if generator is None:
            raise ValueError("noise needs an explicit torch.Generator (never the global RNG)")
        drawn = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype, device=tensor.device)
        tensor = tensor + drawn * noise
    residual = params.get("residual_scale")
    if residual is not None:
        tensor = tensor * residual
    return tensor.clone() if noise is None and residual is None else tensor


def expert_copy(ctx: MergeContext) -> torch.Tensor:
    """One expert's MLP tensor (or a base tensor, with no parameters): a copy, noised and scaled."""
    (tensor,) = ctx.tensors
    return scaled(tensor, ctx.model_params[0], ctx.generator)


def fused_experts(ctx: MergeContext) -> torch.Tensor:
    """transformers' fused expert tensor of one layer: ``gate_up`` stacks each expert's ``cat([gate, up])`` (the
    inputs are gate, up of expert 0, then of expert 1, ...), ``down`` stacks each expert's ``down_proj``. Each
    input is noised and scaled first, in input order."""
    parts = [scaled(t, p, ctx.generator) for t, p in zip(ctx.tensors, ctx.model_params)]
    if ctx.params["part"] == "gate_up":
        return torch.stack([torch.cat([parts[i], parts[i + 1]], dim=0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)


def zeros(ctx: MergeContext) -> torch.Tensor:
    """The zero attention bias Qwen2-MoE requires when the base has none."""
    return torch.zeros(tuple(ctx.params["shape"]), dtype=torch.float32)


for _spec in (
    MethodSpec(name=COPY, fn=expert_copy, min_inputs=1, max_inputs=1, randomized=True,
               reference="mergekit-moe copy_tensor_out / noise_and_scale"),
    MethodSpec(name=FUSED, fn=fused_experts, min_inputs=1, randomized=True,
               reference="transformers' mixtral / qwen3_moe checkpoint conversion"),
    MethodSpec(name=ZEROS, fn=zeros, min_inputs=0, max_inputs=0, reference="mergekit-moe qwen.py"),
):
    register(_spec)

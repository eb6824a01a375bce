"""Fused expert tensors: which output tensors are stacks of experts, to be merged one expert's projection at a time.

transformers 5 holds a MoE layer's experts as 3-D stacks (``mlp.experts.gate_up_proj`` [E, 2I, H] with gate and up
one after the other, ``mlp.experts.down_proj`` [E, H, I]), and some checkpoints store them so: gpt-oss
([E, H, 2I], gate and up interleaved on the last axis, with ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias``),
Llama-4 and Qwen3-VL-MoE ([E, H, 2I], one after the other), Qwen3.5-MoE. A method that is not elementwise (slerp's
angle, TIES' and DELLA's ranks, model_stock's angles, …) must see each expert's gate, up and down projections
alone, as it does when a checkpoint stores them one by one: an expert's result never depends on its neighbours'.

:func:`mark_expert_stacks` is the one place that decides it, from the tensor's name and the donor config's expert
count and expert width (never from shape ratios alone: a narrow expert's 2I may equal H), and records it on the
plan as an :class:`~resumerge.plan.merge_plan.ExpertStack`; the engine merges such a tensor part by part.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from resumerge.methods.registry import get_method
from resumerge.plan.merge_plan import ExpertStack, TensorPlan

# A fused stack's name: ``…experts.gate_up_proj`` (a bias after it) or ``…experts.down_proj`` — never a per-expert
# tensor (``experts.3.down_proj.weight``) nor a shared expert's.
_FUSED = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)(_bias)?(?:\.weight)?$")
_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")


def mark_expert_stacks(tensors: Mapping[str, TensorPlan], config: Mapping[str, Any]) -> dict[str, TensorPlan]:
    """``tensors`` with :attr:`~resumerge.plan.merge_plan.TensorPlan.experts` set on each fused expert stack of the
    model ``config`` describes (its ``text_config`` for a wrapper) that a method which is not elementwise merges;
    the others unchanged (an elementwise method's result is the same either way, and its plan stays as before)."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, Mapping) else config
    count = next((int(cfg[k]) for k in _COUNT_KEYS if isinstance(cfg.get(k), int)), 0)
    width = next((int(cfg[k]) for k in _WIDTH_KEYS if isinstance(cfg.get(k), int)), 0)
    interleaved = cfg.get("model_type") == "gpt_oss"
    out = dict(tensors)
    for name, tp in tensors.items():
        method = get_method(tp.method)  # asked first: an elementwise method's 46k tensors need no name matched
        if method is None or method.elementwise:
            continue
        stack = expert_stack(name, tp.shape, count=count, width=width, interleaved=interleaved)
        if stack is not None:
            out[name] = replace(tp, experts=stack)
    return out


def expert_stack(name: str, shape: tuple[int, ...], *, count: int, width: int,
                 interleaved: bool) -> ExpertStack | None:
    """How tensor ``name`` of ``shape`` stacks ``count`` experts of intermediate ``width`` (None: it does not).

    A weight is 3-D and a bias 2-D, with ``count`` rows. ``gate_up_proj`` holds two projections: interleaved on
    its last axis when ``interleaved`` (gpt-oss), else one after the other on the expert slice's axis that is
    ``2·width`` long (the first when both are: transformers' own layout); one whole projection when neither is."""
    match = _FUSED.search(name)
    if match is None or count < 2 or not shape or shape[0] != count:
        return None
    bias = match.group(2) is not None
    if len(shape) != (2 if bias else 3):
        return None
    if match.group(1) == "down_proj":
        return ExpertStack(count)
    last = len(shape) - 2
    if interleaved and shape[-1] % 2 == 0:
        return ExpertStack(count, parts=2, axis=last, interleaved=True)
    axis = next((a for a in range(len(shape) - 1) if width > 0 and shape[1 + a] == 2 * width), None)
    return ExpertStack(count) if axis is None else ExpertStack(count, parts=2, axis=axis)

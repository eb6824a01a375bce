"""Fused expert tensors: which output tensors are stacks of experts, to be merged one expert's projection at a time.

transformers 5 holds a MoE layer's experts as 3-D stacks (``experts.gate_up_proj`` [E, 2I, H] with gate and up one
after the other, ``experts.down_proj`` [E, H, I]), and some checkpoints store them so: gpt-oss ([E, H, 2I], gate
and up interleaved on the last axis, with ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias``), Llama-4 and
Qwen3-VL-MoE ([E, H, 2I], one after the other), Qwen3.5-MoE ([E, 2I, H]). A method that is not elementwise (slerp's
angle, TIES' and DELLA's ranks, model_stock's angles, …) must see each expert's gate, up and down projections
alone, as it does when a checkpoint stores them one by one: an expert's result never depends on its neighbours'.

Where gate and up lie is a fact of the architecture, declared once in :data:`FUSED_LAYOUTS` (by the donor config's
``model_type``, its ``text_config``'s first), never guessed from shapes: when the hidden size is twice the expert
width both axes of a Llama-4 expert are ``2·I`` long, and concatenated and interleaved halves have the same shape.
The shapes only check the declaration (a stack the config contradicts is refused). For a family the table does not
hold, the stacks and their layout are read from the modules transformers builds for it (:mod:`.expertmodules`:
Granite 4's ``input_linear``, Mistral 4's ``experts.gate_up_proj``); a fused stack found neither way is refused
when a method that is not elementwise would merge it: any rule from its shapes could split it silently wrong, and
an elementwise method (linear, task_arithmetic, …) merges it whole with the same result, needing no layout.

:func:`mark_expert_stacks` is the one place that decides it and records it on the plan as an
:class:`~resumerge.merge.plan.merge_plan.ExpertStack`; the engine merges such a tensor part by part.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.merge.methods.registry import get_method
from resumerge.merge.plan.expertmodules import module_stacks
from resumerge.merge.plan.merge_plan import ExpertStack, TensorPlan


@dataclass(frozen=True)
class FusedLayout:
    """How one family stores ``experts.gate_up_proj``: experts on dim 0 (every family's), then gate and up on
    ``axis`` of one expert's slice (0: [2I, H], 1: [H, 2I]) — gate first, then up (every family's; the split's
    result would not depend on it: each half is merged alone and written back where it was), one whole half after
    the other, or alternating (gate even, up odd) when ``interleaved``. A ``gate_up_proj_bias`` [E, 2I] holds
    them the same way on its one axis."""

    axis: int
    interleaved: bool = False


_CONCATENATED = FusedLayout(axis=0)  # transformers 5's own [E, 2I, H]: gate's I rows, then up's
_TRANSPOSED = FusedLayout(axis=1)  # [E, H, 2I]: gate's I columns, then up's
_INTERLEAVED = FusedLayout(axis=1, interleaved=True)  # [E, H, 2I]: columns 0, 2, 4, … gate; 1, 3, 5, … up

# Each family's fused layout on disk, by config.json's model_type (read in transformers 5.24's
# models/*/modeling_*.py experts classes and conversion_mapping.py).
FUSED_LAYOUTS: Mapping[str, FusedLayout] = MappingProxyType({
    "gpt_oss": _INTERLEAVED,  # GptOssExperts: gate_up[..., ::2], gate_up[..., 1::2]; biases alike
    "llama4": _TRANSPOSED, "llama4_text": _TRANSPOSED,  # Llama4TextExperts: gate_up.chunk(2, dim=-1)
    # Stored [E, H, 2I]; transformers transposes dims 1 and 2 on load (conversion_mapping "qwen3_vl_moe").
    "qwen3_vl_moe": _TRANSPOSED, "qwen3_vl_moe_text": _TRANSPOSED,
    # transformers 5's in-memory form, stored so by Qwen3.5-MoE and Gemma 4 (no conversion on load), by
    # save_pretrained(save_original_format=False) for the families it converts, and by resumerge's own MoE builds
    # of Mixtral and Qwen3-MoE: linear(x, gate_up[e]).chunk(2, dim=-1).
    **dict.fromkeys((
        "gemma4", "gemma4_text", "mixtral", "minimax", "minimax_m2", "qwen2_moe", "qwen3_moe", "qwen3_next",
        "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4v_moe", "glm4v_moe_text",
        "olmoe", "phimoe", "ernie4_5_moe", "dots1", "hunyuan_v1_moe", "flex_olmo", "exaone_moe",
    ), _CONCATENATED),
})

# A fused stack's name: ``…experts.gate_up_proj`` (a bias after it) or ``…experts.down_proj`` — never a per-expert
# tensor (``experts.3.down_proj.weight``) nor a shared expert's.
_FUSED = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)(_bias)?(?:\.weight)?$")
_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")


@dataclass(frozen=True)
class StackFamily:
    """What the donor config says of its fused stacks: its ``model_type`` (the text model's of a wrapper), the
    expert ``count`` and ``width`` (0: not given) and the family's ``layout`` (None: not in FUSED_LAYOUTS)."""

    model_type: str
    count: int
    width: int
    layout: FusedLayout | None


def stack_family(config: Mapping[str, Any]) -> StackFamily:
    """The :class:`StackFamily` of a model's ``config`` (its ``text_config`` for a wrapper)."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, Mapping) else config
    types = [t for t in (cfg.get("model_type"), config.get("model_type")) if isinstance(t, str)]
    model_type = next((t for t in types if t in FUSED_LAYOUTS), types[0] if types else "")
    count = next((int(cfg[k]) for k in _COUNT_KEYS if isinstance(cfg.get(k), int)), 0)
    width = next((int(cfg[k]) for k in _WIDTH_KEYS if isinstance(cfg.get(k), int)), 0)
    return StackFamily(model_type, count, width, FUSED_LAYOUTS.get(model_type))


def mark_expert_stacks(tensors: Mapping[str, TensorPlan], config: Mapping[str, Any]) -> dict[str, TensorPlan]:
    """``tensors`` with :attr:`~resumerge.merge.plan.merge_plan.TensorPlan.experts` set on each fused expert stack of
    the model ``config`` describes that a method which is not elementwise merges; the others unchanged (an
    elementwise method's result is the same either way, and its plan stays as before).

    Raises :class:`ModelInputError` for such a stack of a family :data:`FUSED_LAYOUTS` does not hold, or one whose
    shape the config contradicts."""
    family = stack_family(config)
    out = dict(tensors)
    found: dict[str, ExpertStack | None] | None = None
    for name, tp in tensors.items():
        method = get_method(tp.method)  # asked first: an elementwise method's 46k tensors need no name matched
        if method is None or method.elementwise:
            continue
        if family.layout is None and family.count > 1:  # a family the table does not hold: what its modules say
            if found is None:  # transformers asked only where a planned tensor may be a stack (3-D, an expert a row)
                stacks = [n for n, t in tensors.items() if len(t.shape) == 3 and t.shape[0] == family.count]
                found = module_stacks(config, family.count, tensors) if stacks else {}
            if name in found:
                out[name] = replace(tp, experts=_found(name, tp, found[name], family))
                continue
        stack = expert_stack(name, tp.shape, family, method=tp.method)
        if stack is not None:
            out[name] = replace(tp, experts=stack)
    return out


def _found(name: str, tp: TensorPlan, stack: ExpertStack | None, family: StackFamily) -> ExpertStack:
    """The stack transformers' modules found for planned tensor ``tp``; :class:`ModelInputError` where they do not
    say how it is applied, or it has not the shape they describe."""
    if stack is None or tp.shape[0] != stack.count or (stack.parts > 1 and tp.shape[1 + stack.axis] % stack.parts):
        raise ModelInputError(
            f"{name} is a fused stack of {family.count} experts of model_type {family.model_type!r}, whose layout "
            f"resumerge cannot read from transformers' modules, so {tp.method} cannot merge each expert's "
            "projections apart (it would mix the experts' values)",
            tensor=name,
            hint="merge with an elementwise method (linear, task_arithmetic, …), which merges it whole",
        )
    return stack


def expert_stack(name: str, shape: tuple[int, ...], family: StackFamily, *, method: str) -> ExpertStack | None:
    """How tensor ``name`` of ``shape`` stacks the experts of ``family`` (None: it is not a fused stack), for
    ``method`` (named in a refusal).

    A weight is 3-D and a bias 2-D, with ``family.count`` rows; ``gate_up_proj`` holds gate and up where the
    family's layout says, its halves ``family.width`` long when the config gives it."""
    match = _FUSED.search(name)
    if match is None:
        return None
    kind = f"a fused expert stack of model_type {family.model_type!r}" if family.model_type else \
        "a fused expert stack of a model whose config.json gives no model_type"
    if family.layout is None:
        raise ModelInputError(
            f"{name} is {kind}, whose layout resumerge does not know, so {method} cannot merge each expert's "
            "projections apart (it would mix the experts' values)",
            tensor=name,
            hint="merge with an elementwise method (linear, task_arithmetic, …), which merges it whole, or store "
                 "the experts one tensor each",
        )
    bias = match.group(2) is not None
    axis = 0 if bias else family.layout.axis
    halves = match.group(1) == "gate_up_proj"
    size = shape[1 + axis] if len(shape) == (2 if bias else 3) else None
    if (size is None or family.count < 1 or shape[0] != family.count
            or (halves and (size % 2 or (family.width and size != 2 * family.width)))):
        expect = f"{family.count} experts" + (f" of width {family.width}" if family.width else "")
        where = f", gate and up on axis {1 + axis}" if halves else ""
        raise ModelInputError(
            f"{name} is {list(shape)}, which its config.json contradicts: {kind} of {expect}{where}",
            tensor=name, hint="check the donor model's config.json (its expert count and width)",
        )
    if not halves:
        return ExpertStack(family.count)
    return ExpertStack(family.count, parts=2, axis=axis, interleaved=family.layout.interleaved)

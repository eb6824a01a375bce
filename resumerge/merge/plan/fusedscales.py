"""Output projections that inference engines fuse into one GEMM, grouped so that they share one tensor-wide scale.

vLLM and TensorRT-LLM load q/k/v (and gate/up, and each MoE expert's gate/up or w1/w3) of an NVFP4 checkpoint as
one fused linear with one per-tensor scale (compressed-tensors' ``weight_global_scale``, ModelOpt's
``weight_scale_2``); their quantizers give every member the group's scale, computed from the largest magnitude over
the whole group. The planner decides the groups here, once, from the output tensors' names (a member's codec names
its group: :meth:`~resumerge.inputs.codecs.SharedScale.grouped`, fingerprinted, so a resume of a plan grouped
otherwise is refused); the engine measures each group before it encodes a member
(:class:`~resumerge.merge.engine.groupscales.GroupScales`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from resumerge.inputs.codecs import SharedScale
from resumerge.merge.plan.merge_plan import TensorPlan
from resumerge.merge.plan.tensorkinds import carried_companions

__all__ = ["FUSED_SETS", "fused_notes", "measured_before", "share_scales"]

# Sibling projections of one module that vLLM fuses into one GEMM (its QKVParallelLinear and
# MergedColumnParallelLinear; llm-compressor's fused attention and MLP groups), tried in this order: the first set
# whose every member the module has is its group. Attention: q/k/v, or multi-head latent attention's query and
# fused KV projections (DeepSeek V2/V3, Kimi K2: q_a_proj, or q_proj without a LoRA query); MLP: gate/up, Mixtral's
# experts w1/w3. A module already fused (qkv_proj, gate_up_proj) is one tensor: nothing to share.
FUSED_SETS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("q_proj", "kv_a_proj_with_mqa"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
)


def share_scales(tensors: Mapping[str, TensorPlan]) -> dict[str, TensorPlan]:
    """``tensors`` with the members of each fused group (:data:`FUSED_SETS`, under one parent module) whose output
    codec shares a tensor-wide scale (:class:`~resumerge.inputs.codecs.SharedScale`) encoded as one group: each
    member's codec names the group. Members must be stored in one format (the same codec but for the group), else
    they are left alone (no engine fuses them either). A group whose members are all copies of one model's stored
    parts stays copied (that checkpoint's scales are its own); in any other group a copy is encoded again, with the
    group's scale, its carried companions then its base's like the others'."""
    by_parent: dict[str, dict[str, TensorPlan]] = {}
    for name, tp in tensors.items():
        if isinstance(tp.out_codec, SharedScale) and name.endswith(".weight"):
            parent, _, child = name.removesuffix(".weight").rpartition(".")
            by_parent.setdefault(parent, {})[child] = tp
    out = dict(tensors)
    for children in by_parent.values():
        members = next(([children[c] for c in fused] for fused in FUSED_SETS if all(c in children for c in fused)),
                       None)
        if members is None or len({tp.out_codec for tp in members}) != 1:
            continue
        copied = {tp.inputs[tp.copy_of].model if tp.copy_of is not None else None for tp in members}
        if None not in copied and len(copied) == 1:
            continue
        group = tuple(tp.name for tp in members)
        for tp in members:
            codec = tp.out_codec
            assert isinstance(codec, SharedScale)  # by_parent holds no other
            grouped = codec.grouped(group)
            carried = carried_companions(tp.inputs, grouped, base_index=tp.base_index)
            out[tp.name] = replace(tp, out_codec=grouped, copy_of=None, carried=carried).sized()
    return out


def fused_notes(tensors: Mapping[str, TensorPlan]) -> list[str]:
    """The note of a plan that encodes fused groups with one shared tensor-wide scale each; none when none."""
    groups = {codec.group for tp in tensors.values()
              for codec in (tp.out_codec,) if isinstance(codec, SharedScale) and codec.group}
    if not groups:
        return []
    kinds = sorted({"/".join(name.removesuffix(".weight").rpartition(".")[2] for name in group) for group in groups})
    return [f"{len(groups)} groups of projections that inference engines fuse into one GEMM ({', '.join(kinds)}) "
            "share one NVFP4 tensor-wide scale each (weight_global_scale / weight_scale_2), computed from the largest "
            "magnitude over the whole merged group as compressed-tensors and ModelOpt compute it, so vLLM and "
            "TensorRT-LLM load them fused; each group is measured before its first member is encoded (its members "
            "are merged twice)"]


def measured_before(tensors: Mapping[str, TensorPlan], order: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The group-scale pass of a run writing ``order`` (output tensors of ``tensors``, in the engine's order), as
    the engine makes it (:class:`~resumerge.merge.engine.groupscales.GroupScales`): before the first of a fused
    group's members it writes, every member of the group (written already or not) is merged once more to measure
    the group's largest magnitude. By that first member's name, the members measured before it; what ``plan``
    counts of the pass (their reads, compute and memory)."""
    found: dict[str, tuple[str, ...]] = {}
    seen: set[tuple[str, ...]] = set()
    for name in order:
        codec = tensors[name].out_codec
        if isinstance(codec, SharedScale) and codec.group and codec.group not in seen:
            seen.add(codec.group)
            found[name] = codec.group
    return found

"""Assign output tensors to shards before anything is written.

Greedy by bytes over tensors in name order (mergekit's order, so its shard membership is reproduced): a tensor
joins the current shard unless that would pass the cap and the shard is not empty; a tensor larger than the
cap gets a shard of its own. Names are ``model.safetensors`` for one shard, else
``model-0000i-of-0000N.safetensors``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from resumerge.inputs.safetensors_format import layout_shard
from resumerge.plan.merge_plan import ShardPlan, TensorPlan


def shard_names(count: int) -> list[str]:
    """Final file names for ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def assign_shards(
    tensors: Mapping[str, TensorPlan], cap: int
) -> tuple[tuple[ShardPlan, ...], dict[str, TensorPlan]]:
    """Split ``tensors`` into shards of at most ``cap`` data bytes; returns the shards and tensors with ``shard`` set.

    Each shard lists its tensors in on-disk data order (the safetensors layout), so the engine can write
    sequentially.
    """
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if groups[-1] and size + nbytes > cap:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    names = shard_names(len(groups))
    shards = []
    placed: dict[str, TensorPlan] = {}
    for fname, group in zip(names, groups):
        layout = layout_shard({n: (tensors[n].out_dtype, tensors[n].shape) for n in group})
        shards.append(ShardPlan(fname, tuple(p.name for p in layout.order), layout.file_size))
        for n in group:
            placed[n] = replace(tensors[n], shard=fname)
    return tuple(shards), {n: placed[n] for n in sorted(placed)}

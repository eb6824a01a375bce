"""Assign output tensors to shards before anything is written.

Greedy by bytes over tensors in name order (mergekit's order, so its shard membership is reproduced): a tensor
joins the current shard unless that would pass the cap and the shard is not empty; a tensor larger than the
cap gets a shard of its own. Names are ``model.safetensors`` for one shard, else
``model-0000i-of-0000N.safetensors``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import replace

from resumerge.config.hubtarget import is_hub_target
from resumerge.inputs.safetensors_format import layout_shard
from resumerge.plan.merge_plan import DEFAULT_SHARD_SIZE, ShardPlan, TensorPlan

# An hf:// OUT's shards by default. Each shard is uploaded while the next ones are merged, so the upload link idles
# until the first shard is complete and what the run waits for at its end is the upload of the last ones (and a
# kill loses at most the shard being made). Measured hub to hub at 150/75 MB/s on the 1.75 GB bench pair
# (bench/RESULTS.md, session 13): 200 MB shards start the first upload 6-7 s in (the first shard reads two input
# files), 100 MB ones at 3 s (its first shard is one tensor of the file downloaded first), and the run ends 3-4 s
# sooner; 50 MB gained nothing more (all measured through a stand-in hub that then still stalled under load, see
# session 15; since then shards are computed in input order, resumerge.plan.workorder). Smaller shards add files
# and commits, not bytes: a 140 GB output is 1,400 files (a folder holds at most 10,000 on the hub), in commits
# paced under the hub's quota (see resumerge.store.hubcommits.Batching).
HUB_SHARD_SIZE = 100_000_000


def default_shard_size(to_hub: bool) -> tuple[int, str]:
    """The output shard size when ``--out-shard-size`` is not given, and why (``plan`` shows it): smaller for an
    ``hf://`` OUT (``to_hub``), whose last shard's upload is the tail of the run."""
    if to_hub:
        return HUB_SHARD_SIZE, ("the default for an hf:// OUT: each shard uploads while the next are merged, so "
                                "the run ends one short upload after the merge")
    return DEFAULT_SHARD_SIZE, "the default for a local OUT"


def shard_size_choice(asked: int | str | None, out: str | os.PathLike[str] | None) -> tuple[int | str, str | None]:
    """``--out-shard-size`` as ``asked``, else the default for ``out`` (None: no OUT, as for a local one), and why
    (None when asked)."""
    return (asked, None) if asked is not None else default_shard_size(out is not None and is_hub_target(out))


def shard_names(count: int) -> list[str]:
    """Final file names for ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def assign_shards(
    tensors: Mapping[str, TensorPlan], cap: int, *, last: Collection[str] = ()
) -> tuple[tuple[ShardPlan, ...], dict[str, TensorPlan]]:
    """Split ``tensors`` into shards of at most ``cap`` data bytes; returns the shards and tensors with ``shard`` set.

    Each shard lists its tensors in on-disk data order (the safetensors layout), so the engine can write
    sequentially. The tensors named in ``last`` get the last shard(s) to themselves: the engine runs shards in
    order, so everything else is committed before it waits for them (MoE's routers, computed beside the merge).
    """
    groups: list[list[str]] = []
    for part in ([n for n in sorted(tensors) if n not in last], sorted(n for n in last if n in tensors)):
        size = 0
        if part:
            groups.append([])
        for name in part:
            nbytes = tensors[name].nbytes
            if groups[-1] and size + nbytes > cap:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += nbytes
    groups = groups or [[]]
    names = shard_names(len(groups))
    shards = []
    placed: dict[str, TensorPlan] = {}
    for fname, group in zip(names, groups):
        layout = layout_shard({n: (tensors[n].out_dtype, tensors[n].shape) for n in group})
        shards.append(ShardPlan(fname, tuple(p.name for p in layout.order), layout.file_size))
        for n in group:
            placed[n] = replace(tensors[n], shard=fname)
    return tuple(shards), {n: placed[n] for n in sorted(placed)}

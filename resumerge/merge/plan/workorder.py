"""The order the engine computes a plan's shards in: as their input bytes arrive, not as their files are numbered.

An output shard's file name and contents are the plan's (mergekit's membership, so a local run and an ``hf://``
run of the same settings write the same bytes); the order the shards are computed, published and committed in
is free, since each is written whole and recorded by name. Numbered order reads the inputs out of order: a
Llama's first output file holds ``lm_head``, which sits at the start of each input's last file, beside that model's
last layer, which the output holds last. A run that downloads its inputs (file by file, each into the hub cache)
then fetched those last files first, half of them bytes needed only at the end, before the first shard and its
upload could start, and its downloads split the link between two files per model (bench/RESULTS.md, session 15).

:func:`compute_order` sorts the shards by how far into its model's weights (its files in name order, as a
download or a cold read of them runs) the last input byte each shard reads lies, so the bytes landing first are
the ones merged first. Shards that tie keep their numbered order; a shard that reads no input (MoE routers from
the prompt pass, their own last shard) or whose first tensor shares its inputs with the last tensor of the shard
before (a LoRA module's A and B, computed once for both) comes after every shard numbered before it.

A pure function of the plan. It changes no output byte, so it is not in the plan's fingerprint: a resume computes
the shards it lacks, by name, in this order.

May import only :mod:`resumerge.merge.plan.merge_plan`.
"""

from __future__ import annotations

from resumerge.merge.plan.merge_plan import InputRef, Plan, ShardPlan


def compute_order(plan: Plan) -> tuple[ShardPlan, ...]:
    """``plan``'s shards in the order the engine computes (and so publishes) them."""
    if len(plan.shards) < 2:
        return plan.shards
    offsets: dict[tuple[str, str], int] = {}
    totals: dict[str, int] = {}
    for model, files in plan.inputs.items():
        at = 0
        for name, size, _ in sorted(files):
            offsets[model, name] = at
            at += size
        totals[model] = max(1, at)

    def position(ref: InputRef) -> float:
        at = offsets.get((ref.model, ref.file))
        return 0.0 if at is None else (at + ref.end) / totals[ref.model]

    keys: list[float] = []
    for i, shard in enumerate(plan.shards):
        reach = [position(ref) for name in shard.tensors for ref in plan.tensors[name].reads()]
        if not reach or (i and _shares_inputs(plan, plan.shards[i - 1], shard)):
            # Nothing to wait for from the inputs (MoE routers computed by the prompt pass, their own last shard,
            # must stay last so the merge runs beside the pass), or one computation with the shard before: never
            # earlier than any shard numbered before it.
            reach.append(max(keys, default=0.0))
        keys.append(max(reach))
    order = sorted(range(len(plan.shards)), key=lambda i: (keys[i], i))
    return tuple(plan.shards[i] for i in order)


def _shares_inputs(plan: Plan, before: ShardPlan, after: ShardPlan) -> bool:
    """Whether ``after``'s first tensor reads exactly what ``before``'s last does, with the same parameters: the
    pairs one computation serves (:func:`~resumerge.merge.plan.workunits.collects_sibling`) must stay adjacent."""
    if not before.tensors or not after.tensors:
        return False
    last, first = plan.tensors[before.tensors[-1]], plan.tensors[after.tensors[0]]
    return last.inputs == first.inputs and last.params == first.params

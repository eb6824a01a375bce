"""The engine computes shards as their inputs arrive: a download (or a cold read) of each input's files in name
order feeds the merge in that order, instead of fetching the last file first for the output's first shard."""

from __future__ import annotations

from dataclasses import replace

from conftest import ModelFactory

from resumerge.config.merge_config import load_config_text
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.fetching import first_reads, read_order
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.workorder import compute_order


def _linear_plan(make: ModelFactory) -> Plan:
    # Small input shards: lm_head (named first, so in the output's first file) sits in each input's last file.
    a, b = make("a", shard_bytes=30_000), make("b", seed=1, shard_bytes=30_000)
    text = (f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {b}\n    parameters: {{weight: 0.5}}\n")
    return plan_from_config(load_config_text(text), PlanOptions(out_shard_size=20_000))


def test_downloads_run_through_each_input_in_file_order(make: ModelFactory) -> None:
    plan = _linear_plan(make)
    files = {key: sorted(name for name, _, _ in entries) for key, entries in plan.inputs.items()}
    assert all(len(names) > 2 for names in files.values())
    head = next(s for s in plan.shards if "lm_head.weight" in s.tensors)
    assert head is plan.shards[0]  # numbered order starts with a tensor of each input's last file
    assert {ref.file for ref in plan.tensors["lm_head.weight"].inputs} == {names[-1] for names in files.values()}

    order = compute_order(plan)
    assert sorted(s.name for s in order) == sorted(s.name for s in plan.shards)
    # Each model's files are first read (so downloaded) in name order, give or take a neighbour read by the same
    # shard (the output orders a layer's tensors by name, the inputs by module); the file holding lm_head, which
    # numbered order read first, comes last.
    for key, names in files.items():
        got = [f for k, f in first_reads(plan) if k == key]
        assert got[-1] == names[-1]
        assert all(abs(got.index(name) - i) <= 1 for i, name in enumerate(names)), got
    # The shard reading furthest into the inputs comes last; lm_head's comes after every shard of the layers
    # that precede it in the files.
    assert order.index(head) > len(order) // 2
    # A resume reads first what the first shard it lacks reads.
    done = [s.name for s in order[:3]]
    first_ref = plan.tensors[order[3].tensors[0]].inputs[0]
    assert read_order(plan, done)[0] == (first_ref.model, first_ref.file, first_ref.start, first_ref.end)


def test_a_pair_computed_together_stays_adjacent(make: ModelFactory) -> None:
    """A shard whose first tensor reads exactly what the previous shard's last one reads (a LoRA module's B after
    its A: one decomposition serves both) is never computed before that shard."""
    plan = _linear_plan(make)
    first, second = plan.shards[0], plan.shards[1]
    order = compute_order(plan)
    assert order.index(second) < order.index(first)  # apart, the later inputs' shard goes after
    last = plan.tensors[first.tensors[-1]]
    twin = replace(plan.tensors[second.tensors[0]], inputs=last.inputs, params=last.params)
    paired = replace(plan, tensors={**plan.tensors, second.tensors[0]: twin})
    order = compute_order(paired)
    assert order.index(paired.shards[1]) == order.index(paired.shards[0]) + 1


def test_one_shard_and_ties_keep_numbered_order(make: ModelFactory) -> None:
    plan = _linear_plan(make)
    single = replace(plan, shards=plan.shards[:1])
    assert compute_order(single) == single.shards
    # Shards reading nothing from the inputs (all at position 0) keep their numbered order.
    empty = replace(plan, tensors={n: replace(t, inputs=()) for n, t in plan.tensors.items()})
    assert compute_order(empty) == plan.shards


def test_a_shard_reading_no_input_stays_after_the_shards_numbered_before_it(make: ModelFactory) -> None:
    """MoE routers from the prompt pass are their own last shard and read no input: computed first, they would make
    the merge wait for the whole pass instead of running beside it."""
    plan = _linear_plan(make)
    last = plan.shards[-1]
    computed = replace(plan, tensors={**plan.tensors,
                                      **{n: replace(plan.tensors[n], inputs=()) for n in last.tensors}})
    assert compute_order(computed)[-1] == last

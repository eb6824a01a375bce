"""An hf:// OUT's default shard size is picked per run from the output's bytes, recorded in the plan, and shown.

Small shards shorten the run's tail (what is still to upload once the last input byte has landed: the shards that
read it, and every tensor the output's name order puts beside them); every file costs a preupload call in the hub's
API quota, so the size grows with the output and the run makes about ``HUB_SHARD_FILES`` files.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import ModelFactory

from resumerge import api
from resumerge.config.merge_config import load_config_text
from resumerge.errors import UsageError
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.merge_plan import DEFAULT_SHARD_SIZE, Plan, PlanOptions, TensorPlan, compute_fingerprint
from resumerge.merge.plan.sharding import (
    AUTO_SHARD_SIZE,
    HUB_MAX_SHARD,
    HUB_MIN_SHARD,
    HUB_SHARD_FILES,
    default_shard_size,
    hub_shard_size,
    resolve_shard_size,
    shard_size_choice,
)

MB, GB = 10**6, 10**9


def _tensors(*sizes: int) -> dict[str, TensorPlan]:
    return {f"t{i}": TensorPlan(f"t{i}", "", "linear", (), None, (), (), (n,), None, "U8", n)
            for i, n in enumerate(sizes)}


@pytest.mark.parametrize(("output", "expected"), [
    (3 * MB, HUB_MIN_SHARD),  # a test model: one file
    (1_750_212_608, HUB_MIN_SHARD),  # the bench pair's 1.75 GB output: 25 MB, 59 files (not 22 of 100 MB)
    (14_483_464_192, 145 * MB),  # a 7B in fp16: about 100 files
    (141_107_412_992, 1412 * MB),  # a 70B in fp16: 100 files still
    (673_161_837_152, HUB_MAX_SHARD),  # DeepSeek-V3 x R1 in block FP8: 135 files of 5 GB, the hub's comfortable size
])
def test_the_hub_shard_size_is_a_hundredth_of_the_output_within_bounds(output: int, expected: int) -> None:
    size = hub_shard_size(_tensors(output // 3, output // 3, output - 2 * (output // 3)))
    assert size == expected
    assert size % MB == 0 and HUB_MIN_SHARD <= size <= HUB_MAX_SHARD
    if HUB_MIN_SHARD < size < HUB_MAX_SHARD:
        assert output / size <= HUB_SHARD_FILES < output / (size - MB)


def test_only_the_hub_default_is_picked_by_the_planner() -> None:
    assert default_shard_size(True)[0] is None and default_shard_size(False)[0] == DEFAULT_SHARD_SIZE
    assert shard_size_choice(None, "hf://alice/out")[0] is None
    assert shard_size_choice("50M", "hf://alice/out") == ("50M", None)  # asked: used as given, no reason shown
    tensors = _tensors(400 * MB, 400 * MB)
    asked = PlanOptions(out_shard_size=7 * MB)
    assert resolve_shard_size(asked, tensors) is asked
    assert resolve_shard_size(PlanOptions(out_shard_size=AUTO_SHARD_SIZE), tensors).out_shard_size == HUB_MIN_SHARD


def test_a_zero_shard_size_is_still_refused() -> None:
    with pytest.raises(UsageError, match=r"^out_shard_size must be positive"):
        api.plan_merge("unused.yml", settings=api.Settings(output=api.Output(out_shard_size=0)))


def _plan(make: ModelFactory, options: PlanOptions) -> Plan:
    a, b = make("a", shard_bytes=30_000), make("b", seed=1, shard_bytes=30_000)
    text = (f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
            f"  - model: {b}\n    parameters: {{weight: 0.5}}\n")
    return plan_from_config(load_config_text(text), options)


def test_the_plan_records_the_size_it_picked_so_a_resume_plans_the_same(make: ModelFactory) -> None:
    picked = _plan(make, PlanOptions(out_shard_size=AUTO_SHARD_SIZE))
    assert picked.options.out_shard_size == HUB_MIN_SHARD
    # A resume plans from the recorded options (the ledger's and the manifest's are asdict(plan.options)).
    again = _plan(make, PlanOptions(**{**picked.options.__dict__}))
    assert compute_fingerprint(again) == compute_fingerprint(picked)
    assert compute_fingerprint(_plan(make, replace(picked.options, out_shard_size=50_000))) != (
        compute_fingerprint(picked))

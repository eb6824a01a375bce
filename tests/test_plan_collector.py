"""``resumerge plan``'s process keeps the plan it built until it ends: the cyclic garbage collector is paused over
the planning and the estimate as one block, and what they built is frozen, not walked (issue 87 item 15: the
collections after planning DeepSeek-V3 x R1 from ``hf://`` cost 0.23-0.58 CPU s, which one depended on the
collector's counters). A library call leaves nothing frozen."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from conftest import ModelFactory
from support import linear_config, write_config

from resumerge import api
from resumerge.machine.memory import collector_paused


@pytest.fixture(autouse=True)
def _nothing_frozen() -> None:
    # A command run in this worker before (a refusal's exit_with) may have left objects frozen: start from none.
    gc.unfreeze()


def _walked(obj: object) -> bool:
    """Whether the collector's generations hold ``obj`` (a frozen object is in none of them)."""
    return any(o is obj for o in gc.get_objects())


def test_a_fresh_process_plan_is_frozen_and_a_library_one_is_not(tmp_path: Path, make: ModelFactory) -> None:
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    assert gc.get_freeze_count() == 0
    try:
        fresh = api.estimate(cfg, tmp_path / "out", probe_size=0, fresh_process=True)
        assert gc.isenabled() and gc.get_freeze_count() > 0
        assert gc.is_tracked(fresh.plan) and not _walked(fresh.plan)
        assert not any(_walked(tp) for tp in fresh.plan.tensors.values())
    finally:
        gc.unfreeze()
    library = api.estimate(cfg, tmp_path / "out", probe_size=0)
    assert gc.isenabled() and gc.get_freeze_count() == 0 and _walked(library.plan)
    assert library.plan.fingerprint == fresh.plan.fingerprint


def test_the_collector_freezes_only_a_block_that_returns() -> None:
    try:
        with pytest.raises(RuntimeError), collector_paused(freeze=True):
            raise RuntimeError
        assert gc.isenabled() and gc.get_freeze_count() == 0
        with collector_paused(freeze=True):
            kept = [object()]
        assert gc.isenabled() and gc.get_freeze_count() > 0 and not _walked(kept)
    finally:
        gc.unfreeze()

"""``resumerge plan``'s process keeps the plan it built until it ends: the cyclic garbage collector is paused over
the planning and the estimate as one block, and what they built is frozen, not walked (issue 87 item 15: the
collections after planning DeepSeek-V3 x R1 from ``hf://`` cost 0.23-0.58 CPU s, which one depended on the
collector's counters). A library call leaves nothing frozen.

A run freezes what exists as it starts and thaws it as it ends, where nothing was frozen before; a caller's own
freeze (a notebook's ``gc.freeze()``, the test worker's after its collection: tests/conftest.py) survives a run
whole, and nothing the run made stays frozen (a collection still frees what it let go)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
from conftest import ModelFactory
from support import linear_config, write_config

from resumerge import api
from resumerge.machine.memory import collector_paused
from resumerge.machine.memory.collector import alive_frozen


@pytest.fixture
def thawed() -> Iterator[None]:
    """Nothing frozen while the test runs (the worker froze what its collection left: tests/conftest.py, and a
    command run in this worker before may have frozen more); as the collection left it again after the test."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


def _walked(obj: object) -> bool:
    """Whether the collector's generations hold ``obj`` (a frozen object is in none of them)."""
    return any(o is obj for o in gc.get_objects())


class _Node:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_fresh_process_plan_is_frozen_and_a_library_one_is_not(tmp_path: Path, make: ModelFactory,
                                                                   thawed: None) -> None:
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


def test_the_collector_freezes_only_a_block_that_returns(thawed: None) -> None:
    with pytest.raises(RuntimeError), collector_paused(freeze=True):
        raise RuntimeError
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with collector_paused(freeze=True):
        kept = [object()]
    assert gc.isenabled() and gc.get_freeze_count() > 0 and not _walked(kept)


def test_a_block_freezes_what_it_found_and_thaws_it_where_nothing_was_frozen(thawed: None) -> None:
    found = [object()]
    for raising in (False, True):
        with pytest.raises(RuntimeError) if raising else nullcontext(), alive_frozen():
            made = [object()]
            assert gc.get_freeze_count() > 0 and not _walked(found) and _walked(made)
            if raising:
                raise RuntimeError
        assert gc.get_freeze_count() == 0 and _walked(found)


def test_a_block_keeps_a_callers_freeze_and_freezes_nothing_more() -> None:
    node = _Node()
    gc.freeze()  # the caller's (the worker froze its collection's objects already; this one is the test's own)
    before = gc.get_freeze_count()
    ref = weakref.ref(node)
    with alive_frozen():
        later = _Node()
        assert gc.get_freeze_count() == before and _walked(later) and not _walked(node)
        late = weakref.ref(later)
        del later
        gc.collect()  # the governor's reclaim in a run: what the block let go is freed
        assert late() is None
    assert gc.get_freeze_count() == before and ref() is not None


def test_a_run_keeps_a_callers_freeze_and_freezes_nothing_of_its_own(tmp_path: Path, make: ModelFactory) -> None:
    """The engine thawed every frozen object as a run ended: a notebook's ``gc.freeze()`` (made to keep its objects
    out of the collections, or shared with the processes it forks) was undone by its first merge. (The count may
    fall: a frozen object is still freed when its last reference goes.)"""
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    mine = [object()]
    gc.freeze()
    before = gc.get_freeze_count()
    api.run(cfg, tmp_path / "out")
    after = gc.get_freeze_count()
    assert 0 < after <= before and not _walked(mine)
    api.run(cfg, tmp_path / "again")
    assert 0 < gc.get_freeze_count() <= after and not _walked(mine)


def test_a_run_in_a_process_with_nothing_frozen_freezes_while_it_runs_and_thaws(
        tmp_path: Path, make: ModelFactory, thawed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_config(tmp_path / "c.yml", linear_config(make("a", seed=1), make("b", seed=2)))
    calls: list[tuple[str, int]] = []

    def recorded(name: str, call: Callable[[], None]) -> None:
        call()
        calls.append((name, gc.get_freeze_count()))

    for name in ("freeze", "unfreeze"):
        monkeypatch.setattr(gc, name, partial(recorded, name, getattr(gc, name)))
    api.run(cfg, tmp_path / "out")
    assert [name for name, _ in calls] == ["freeze", "unfreeze"] and calls[0][1] > 0
    assert gc.get_freeze_count() == 0

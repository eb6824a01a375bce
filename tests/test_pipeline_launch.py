"""How the executor's pipeline starts a group of units (resumerge.merge.engine.executor): the workspaces it lends and
the memory it reserves, without a plan (fake units, a probe that reports what the workspaces hold)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from resumerge.machine.memory import MemoryGovernor, Pacing
from resumerge.machine.torch_import import torch
from resumerge.merge.engine.executor import _Pipeline
from resumerge.merge.engine.unitgroup import UnitGroup
from resumerge.merge.engine.workspace import Workspace
from resumerge.merge.methods.resources import NO_RESOURCES

BUDGET = 1 << 23  # half of it is a tensor large enough for a workspace to keep (WARM_BYTES up)


@dataclass
class _Probe:
    """Host memory as what the ``held`` workspaces hold (the run's buffers between tensors)."""

    held: list[Workspace] = field(default_factory=list)

    def rss(self) -> int:
        return sum(w.held_bytes for w in self.held)

    def available(self) -> int:
        return 64 * BUDGET

    def limit(self) -> int | None:
        return None

    def reclaim(self) -> None:
        pass


@dataclass
class _Tensor:
    name: str


@dataclass
class _Unit:
    """A unit that records the workspace it is computed in."""

    tp: _Tensor = field(default_factory=lambda: _Tensor("t"))
    lent: list[Workspace | None] = field(default_factory=list)

    def whole(self, workspace: Workspace | None = None) -> Any:
        self.lent.append(workspace)
        return {}


@pytest.fixture
def pipeline() -> Iterator[tuple[_Pipeline, MemoryGovernor, _Probe]]:
    probe = _Probe()
    governor = MemoryGovernor(BUDGET, probe, pacing=Pacing(margin_fraction=0.0))
    # a writer without a buffer pool: the workspaces' own buffers, as before the writer lent them one
    writer = cast(Any, SimpleNamespace(pool=None))
    line = _Pipeline(cast(Any, None), cast(Any, None), writer, governor, 1, lambda: False, NO_RESOURCES)
    yield line, governor, probe
    line.close()


def _group(sibling: bool = False) -> tuple[UnitGroup, _Unit]:
    unit = _Unit()
    group = UnitGroup(cast(Any, None), alone=True, sibling=sibling)
    group.add(cast(Any, unit), 1000)
    return group, unit


def test_a_unit_admitted_alone_over_the_headroom_finds_the_idle_workspaces_emptied(
        pipeline: tuple[_Pipeline, MemoryGovernor, _Probe]) -> None:
    line, governor, probe = pipeline
    with line.workspaces.lend() as workspace:  # a large tensor filled the worker's workspace (half the budget)
        workspace.take("input0", (BUDGET // 2,), torch.uint8)
        probe.held.append(workspace)
    assert workspace.held_bytes == BUDGET // 2
    # Sized against the whole budget: beside the workspace it would be admitted alone over the headroom.
    admitted, reservation = line._admit("large", 3 * BUDGET // 4, governor)
    assert admitted and reservation is not None
    assert workspace.held_bytes == 0
    assert not [a for a in governor.adaptations if a.knob == "admit_alone"]
    reservation.release()


def test_a_group_collecting_its_siblings_result_is_lent_no_workspace(
        pipeline: tuple[_Pipeline, MemoryGovernor, _Probe]) -> None:
    line, _, _ = pipeline
    group, unit = _group(sibling=True)
    line._compute(group, None, False)
    working, other = _group()
    line._compute(working, None, False)
    assert unit.lent == [None] and isinstance(other.lent[0], Workspace)


def test_a_group_the_pool_refuses_gives_its_reservation_back(
        pipeline: tuple[_Pipeline, MemoryGovernor, _Probe]) -> None:
    line, governor, _ = pipeline
    line.pool.shutdown()
    group, _ = _group()
    with pytest.raises(RuntimeError, match="shutdown"):
        line._launch(group, False)
    governor.acquire(BUDGET, timeout=0).release()  # nothing is held: the whole budget is admitted at once

"""The engine's line of groups in flight (resumerge.merge.engine.inflight): a worker freed by a finished group takes the
next one while an older group still computes, and the writer gets every group in the order it was started."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from resumerge.machine.memory import FakeProbe, MemoryGovernor, Pacing, Reservation
from resumerge.merge.engine.inflight import HELD_PER_WORKER, InFlight


@dataclass(frozen=True)
class _Group:
    name: str
    sibling: bool = False


def _line(workers: int = 2, stop_after: int | None = None) -> tuple[InFlight[_Group, str], list[str]]:
    written: list[str] = []

    def put(group: _Group, result: str, reservation: Reservation | None) -> bool:
        assert result == group.name  # each group's own result reaches the writer
        written.append(result)
        return stop_after is None or len(written) < stop_after

    return InFlight(workers, put), written


def _started(line: InFlight[_Group, str], name: str, *, done: bool = False, sibling: bool = False) -> Future[str]:
    future: Future[str] = Future()
    future.set_running_or_notify_cancel()
    if done:
        future.set_result(name)
    line.add(_Group(name, sibling), future, None)
    return future


def test_a_worker_freed_beside_a_long_group_takes_the_next_one_and_the_writer_keeps_the_order() -> None:
    line, written = _line()
    long = _started(line, "long")
    _started(line, "short", done=True)
    # Two workers, one of them free: the next group starts now, not once the long one is written.
    assert line.make_room(False, limit=2)
    assert written == [] and line.working() == 1
    _started(line, "next", done=True)
    long.set_result("long")
    assert line.flush()
    assert written == ["long", "short", "next"]


def test_finished_groups_at_the_head_go_to_the_writer_as_soon_as_room_is_asked() -> None:
    line, written = _line()
    _started(line, "a", done=True)
    b = _started(line, "b")
    _started(line, "c", done=True)
    assert line.make_room(False, limit=2)
    assert written == ["a"]  # b still computes: c waits behind it
    b.set_result("b")
    assert line.make_room(False, limit=2)
    assert written == ["a", "b", "c"] and len(line) == 0


def test_when_every_worker_computes_room_waits_for_the_first_to_finish_whichever_it_is() -> None:
    line, written = _line()
    _started(line, "old")
    young = _started(line, "young")
    threading.Timer(0.05, young.set_result, args=("young",)).start()
    assert line.make_room(False, limit=2)  # returns once the younger group is done; the older still computes
    assert young.done() and line.working() == 1 and written == []


def test_the_line_holds_at_most_its_share_per_worker_behind_a_long_group() -> None:
    line, written = _line(workers=1)
    long = _started(line, "long")
    for i in range(HELD_PER_WORKER - 1):
        _started(line, f"short{i}", done=True)
    threading.Timer(0.05, long.set_result, args=("long",)).start()
    assert line.make_room(False, limit=1)  # full: the long group is waited for and written first
    assert written[0] == "long" and long.done()


def test_a_free_worker_takes_six_groups_behind_a_long_one_on_two_workers() -> None:
    """A GGUF release's layer on 2 workers: its down_proj (7 encodings of 1536-column rows, 1.0 CPU s) is the oldest
    group while the other worker computes the layer's 6 others (0.7 s together) and the next layer's first: with
    room for only 2 finished groups behind it, that worker waited for the down_proj (a core idle about a third of
    each layer). At 4 per worker: 6 finished behind a long one, and a 7th starts."""
    line, written = _line(workers=2)
    long = _started(line, "long")
    for i in range(6):
        _started(line, f"short{i}", done=True)
    threading.Timer(0.3, long.set_result, args=("long",)).start()
    assert line.make_room(False, limit=2)  # room at once: nothing waits for the long group
    assert written == [] and not long.done() and line.working() == 1
    _started(line, "next")
    assert line.working() == 2


def test_a_group_collecting_its_siblings_result_needs_no_free_worker() -> None:
    line, _ = _line()
    _started(line, "a")
    _started(line, "b")
    assert line.working() == 2
    assert line.make_room(True, limit=2)  # returns at once: it computes nothing
    _started(line, "b's sibling", sibling=True)
    assert line.working() == 2


def test_a_stopped_writer_ends_the_wait_and_close_releases_what_is_left() -> None:
    line, written = _line(stop_after=1)
    _started(line, "a", done=True)
    released: list[str] = []
    future: Future[str] = Future()
    line.add(_Group("b"), future, Reservation(lambda r: released.append(str(r.what)), 10, "b"))
    assert not line.make_room(False, limit=1)
    assert written == ["a"]
    line.close()
    assert released == ["b"] and future.cancelled() and len(line) == 0


def test_close_keeps_a_still_computing_groups_memory_reserved_until_its_computation_ends() -> None:
    governor = MemoryGovernor(1000, FakeProbe(), pacing=Pacing(margin_fraction=0))
    line, _ = _line()
    computing: Future[str] = Future()
    computing.set_running_or_notify_cancel()  # its worker has it: it cannot be cancelled
    line.add(_Group("computing"), computing, governor.acquire(600, what="computing"))
    line.close()
    assert not computing.cancelled() and len(line) == 0
    with pytest.raises(TimeoutError):  # its worker still holds the memory: nothing more fits beside it
        governor.acquire(600, timeout=0.05, what="next")
    computing.set_result("computing")
    governor.acquire(600, timeout=1, what="next").release()


def test_the_merge_s_governor_admits_as_many_units_as_the_line_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group in the line holds its reservation until written, so the merge's governor counts the finished
    ones behind a long group as in flight: at its default of 4 it held the line at 4 whatever the line allowed (a
    7-type release's other worker waited behind each layer's down_proj). It admits what the line holds."""
    from types import SimpleNamespace
    from typing import cast

    from resumerge.merge.engine import devices
    from resumerge.merge.engine.inflight import CONCURRENCY
    from resumerge.merge.plan.merge_plan import Plan
    from resumerge.merge.plan.workunits import Oversized

    class _Calm:  # a process far under its budget (the suite's worker may hold more than the 1 GiB below)
        def rss(self) -> int:
            return 1 << 20

        def available(self) -> int:
            return 1 << 40

    monkeypatch.setattr(devices, "SystemProbe", _Calm)
    monkeypatch.setattr(devices, "run_baseline", lambda plan: 1 << 20)
    monkeypatch.setattr(devices, "smallest_run_budget", lambda plan, baseline: Oversized("", "", 2 << 20))
    governor = devices.make_governor(cast(Plan, SimpleNamespace(tensors={})), 1 << 30)
    assert governor.in_flight_limit == HELD_PER_WORKER * CONCURRENCY == 8
    reservations = [governor.acquire(1, timeout=1, what=f"unit {i}") for i in range(8)]
    with pytest.raises(TimeoutError):
        governor.acquire(1, timeout=0.05, what="a ninth")
    for each in reservations:
        each.release()

"""A forward pass's actor hosted by a kept Ray worker, without a cluster (resumerge.machine.cluster.hostcalls and
.hosting): the calls of the lease that holds the worker run one at a time in the order the driver sent them, whatever
order its threads take them in; a call of an ended lease is refused; the lease's end closes the pass's object once
its running call returned; what the object raised as it was made is raised by every call after; the driver's
stand-in numbers its calls as sent. A pass on a real cluster that leases the kept workers (the same processes for a
second pass, after a killed driver; never another code's): tests/test_ray_passes.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from resumerge.errors import UsageError
from resumerge.machine.cluster.hostcalls import EndedLease, Hosting
from resumerge.machine.cluster.hosting import Hosted


class _Pass:
    """A pass's object: records its calls, the one running at a time."""

    def __init__(self, log: list[str], fail: bool = False) -> None:
        if fail:
            raise UsageError("no model here")
        self.log, self.running = log, 0
        self.closed = False

    def step(self, name: str, seconds: float = 0.0) -> str:
        self.running += 1
        assert self.running == 1  # one call at a time
        time.sleep(seconds)
        self.log.append(name)
        self.running -= 1
        return name

    def close(self) -> None:
        self.closed = True


def _threads(*calls: Any) -> list[threading.Thread]:
    started = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in started:
        thread.start()
    return started


def test_a_leases_calls_run_one_at_a_time_in_the_order_sent_whatever_order_they_arrive_in() -> None:
    hosting, log = Hosting(), []
    hosting.begin("lease-1")
    results: dict[int, str] = {}

    def call(seq: int) -> Any:
        return lambda: results.__setitem__(seq, hosting.call("lease-1", seq, "step", f"c{seq}", 0.01))

    threads = _threads(call(3), call(2))  # the later calls arrive first, and wait for their turn
    time.sleep(0.05)
    assert log == [] and not results
    threads += _threads(call(1))
    hosting.host("lease-1", 0, _Pass, log)
    for thread in threads:
        thread.join(5)
    assert log == ["c1", "c2", "c3"] and results == {1: "c1", 2: "c2", 3: "c3"}


def test_an_ended_leases_calls_are_refused_and_its_object_closed_once_its_running_call_returned() -> None:
    hosting, log = Hosting(), []
    hosting.begin("lease-1")
    hosting.host("lease-1", 0, _Pass, log)
    made = hosting.hosted
    failed: list[BaseException] = []

    def waiting() -> None:  # call 3 waits for call 2, which never comes: the lease ends first
        try:
            hosting.call("lease-1", 3, "step", "late")
        except EndedLease as exc:
            failed.append(exc)

    running = _threads(lambda: hosting.call("lease-1", 1, "step", "slow", 0.3))
    left = _threads(waiting)
    time.sleep(0.1)
    hosting.end()  # waits for the running call, refuses the waiting one
    assert log == ["slow"] and made.closed
    for thread in running + left:
        thread.join(5)
    assert len(failed) == 1 and hosting.hosted is None
    with pytest.raises(EndedLease):
        hosting.call("lease-1", 2, "step", "after")
    # The next lease starts from its call 0, on a fresh object.
    hosting.begin("lease-2")
    with pytest.raises(EndedLease):
        hosting.call("lease-1", 0, "step", "old lease")
    hosting.host("lease-2", 0, _Pass, log)
    assert hosting.call("lease-2", 1, "step", "new") == "new" and hosting.hosted is not made


def test_what_the_pass_object_raised_as_it_was_made_is_raised_by_the_calls_after_and_its_end_drops_it() -> None:
    hosting = Hosting()
    hosting.begin("lease-1")
    hosting.host("lease-1", 0, _Pass, [], True)
    with pytest.raises(UsageError, match="no model here"):
        hosting.call("lease-1", 1, "step", "x")
    hosting.end()  # nothing to close
    assert hosting.hosted is None and hosting.failed is None


def test_the_drivers_stand_in_numbers_its_calls_as_sent_under_its_lease() -> None:
    sent: list[tuple[Any, ...]] = []
    actor = SimpleNamespace(host=SimpleNamespace(remote=lambda *args: sent.append(("host", *args))),
                            call=SimpleNamespace(remote=lambda *args, **kw: sent.append(("call", *args, kw))))
    hosted = Hosted(SimpleNamespace(actor=actor, token=SimpleNamespace(hex=lambda: "t1")))  # type: ignore[arg-type]
    hosted.host(_Pass, "log")
    hosted.layer.remote(0, None)
    hosted.head.remote(1, share=True)
    assert sent == [("host", "t1", 0, _Pass, "log"), ("call", "t1", 1, "layer", 0, None, {}),
                    ("call", "t1", 2, "head", 1, {"share": True})]
    with pytest.raises(AttributeError):
        hosted._private  # noqa: B018 (not a remote method: pickling and copying probe such names)

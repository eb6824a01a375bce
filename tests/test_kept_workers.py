"""A kept Ray worker's leases without a cluster (resumerge.engine.cluster.keeper): a live run's lease is never taken, a
dead run's is taken back only after its stream stopped (by the next lease or by the watchdog on its own, which reads
that fail otherwise do not stop), a release by another run's token changes nothing, a worker idle for its time
refuses every lease and ends, and a worker refuses a run of other code; ``--keep-workers`` is read as a length, 0
keeping none; a run whose node's kept workers live runs hold leases the next slots, up to the spare ones. The kept
workers on a real cluster: tests/test_ray_executor.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from resumerge.api.options import keep_option, run_settings
from resumerge.config.settings import KEEP_WORKERS
from resumerge.engine.cluster import keeper, kept
from resumerge.engine.cluster.keeper import Keeper, code_digest
from resumerge.engine.cluster.kept import SPARE_SLOTS, kept_name
from resumerge.errors import UsageError


class OwnerDied(Exception):
    """Stands in for ray.exceptions.OwnerDiedError."""


class _Token:
    """A lease's token: reading it raises once its driver died."""

    def __init__(self, name: str) -> None:
        self.name, self.dead, self.broken = name, False, False

    def hex(self) -> str:
        return self.name


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A Ray whose reads of a token raise for a dead driver's; the list gets "ended" when a worker ends itself. Every
    worker made meanwhile is ended before the real Ray is put back (its watchdog would read tokens with it)."""
    ended: list[str] = []

    def get(token: _Token, timeout: float) -> str:
        if token.broken:
            raise RuntimeError("a read that fails otherwise")
        if token.dead:
            raise OwnerDied()
        return "code"

    ray = SimpleNamespace(get=get, exceptions=SimpleNamespace(ObjectLostError=OwnerDied, GetTimeoutError=TimeoutError))
    monkeypatch.setattr(keeper, "require_ray", lambda: ray)
    monkeypatch.setattr(keeper, "_end_actor", lambda: ended.append("ended"))
    monkeypatch.setattr(keeper, "WATCH_SECONDS", 0.02)
    yield ended
    for worker in _MADE:
        with worker.lock:
            worker.holder, worker.keep = None, 0.0
        worker.watchdog.join(5)
        assert not worker.watchdog.is_alive()
    _MADE.clear()


_MADE: list[Keeper] = []


def _kept(keep: float = 60.0) -> tuple[Keeper, list[str]]:
    renewed: list[str] = []
    _MADE.append(Keeper(keep, lambda: renewed.append("renewed")))
    return _MADE[-1], renewed


def test_a_live_runs_lease_is_never_taken_and_a_dead_ones_only_after_its_stream_stopped(fake_ray: list[str]) -> None:
    worker, renewed = _kept()
    code, first, second = code_digest(), _Token("first"), _Token("second")
    assert worker.lease([first], code, 60.0) == 0 and renewed == ["renewed"]
    assert worker.lease([second], code, 60.0) is None  # the first run's driver lives
    worker.release([second])  # not its lease: nothing changes
    assert worker.leased() and renewed == ["renewed"]
    first.dead = True  # the first run's driver died: the next lease stops its stream, then serves
    assert worker.lease([second], code, 60.0) == 1 and renewed == ["renewed"] * 2
    worker.release([second])
    assert not worker.leased() and renewed == ["renewed"] * 3


def test_the_watchdog_takes_a_dead_runs_lease_back_on_its_own(fake_ray: list[str]) -> None:
    worker, renewed = _kept()
    token = _Token("run")
    assert worker.lease([token], code_digest(), 60.0) == 0
    time.sleep(0.1)
    assert worker.leased()  # its driver lives
    token.broken = True  # reads that fail otherwise: the watchdog goes on watching
    time.sleep(0.1)
    assert worker.leased() and worker.watchdog.is_alive()
    token.broken, token.dead = False, True
    deadline = time.monotonic() + 5
    while worker.leased():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert renewed == ["renewed"] * 2 and fake_ray == []  # stopped and fresh, not ended


def test_an_idle_worker_ends_after_its_time_and_refuses_leases_then(fake_ray: list[str]) -> None:
    worker, _ = _kept(keep=60.0)
    token = _Token("run")
    assert worker.lease([token], code_digest(), 0.1) == 0  # the lease sets the time kept idle after it
    time.sleep(0.3)
    assert fake_ray == []  # leased: never ends
    worker.release([token])
    deadline = time.monotonic() + 5
    while not fake_ray:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker.lease([_Token("late")], code_digest(), 60.0) is None


def test_a_worker_refuses_a_run_of_other_code(fake_ray: list[str]) -> None:
    worker, renewed = _kept()
    assert worker.lease([_Token("run")], "0123456789abcdef", 60.0) is None and renewed == []


def test_the_code_digest_follows_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    before = code_digest()
    assert before == code_digest() and len(before) == 16
    monkeypatch.setattr(keeper, "__version__", "0.0.0-other")
    assert code_digest() != before


def test_keep_workers_is_a_length_and_0_keeps_none() -> None:
    assert keep_option(None) == KEEP_WORKERS == 600.0
    assert keep_option("0") == 0.0 and keep_option(0) == 0.0
    assert keep_option("10m") == 600.0 and keep_option("90s") == 90.0 and keep_option(30) == 30.0
    for bad in ("soon", "-1m", -1):
        with pytest.raises(UsageError, match=r"keep.workers"):  # (the API names its parameter)
            keep_option(bad)
    with pytest.raises(UsageError, match=r"keep.workers needs .*executor"):
        run_settings(state_dir=None, keep_workers="10m")


class _Actors:
    """A Ray whose kept workers answer leases as ``answers`` says by name (absent: a new worker, 0 runs served);
    records the names a run asked for."""

    def __init__(self, answers: dict[str, int | None]) -> None:
        self.answers, self.asked = answers, []
        self.exceptions = SimpleNamespace(GetTimeoutError=TimeoutError, RayError=RuntimeError)

    def put(self, value: str) -> str:
        return value

    def remote(self, cls: type) -> _Actors:
        return self

    def options(self, *, name: str, **options: object) -> SimpleNamespace:
        self.asked.append(name)
        answer = self.answers.get(name, 0)
        lease = SimpleNamespace(remote=lambda box, code, keep: answer)
        return SimpleNamespace(remote=lambda *args: SimpleNamespace(name=name, lease=lease))

    def get(self, answer: int | None, timeout: float) -> int | None:
        return answer


def test_a_run_leases_the_next_slots_where_live_runs_hold_a_nodes_kept_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, busy, full = code_digest(), "a" * 16, "b" * 16
    # Node a: slot 0 held by a live run, slot 1 kept from 3 runs before; node b: every slot held.
    answers = {kept_name(code, busy, 0): None, kept_name(code, busy, 1): 3,
               **{kept_name(code, full, slot): None for slot in range(2 + SPARE_SLOTS)}}
    ray = _Actors(answers)
    monkeypatch.setattr(kept, "_pinned", lambda node_id: None)
    nodes = [{"NodeID": node, "Alive": True, "Resources": {"CPU": 2, "memory": 1e12}} for node in (busy, full)]
    workers, reused = kept.lease(ray, nodes, 1, 60.0)  # type: ignore[arg-type]
    assert [w.actor.name for w in workers] == [kept_name(code, busy, slot) for slot in (1, 2)] and reused == 1
    assert {w.token for w in workers} == {code} and {w.width for w in workers} == {1}
    assert ray.asked == [kept_name(code, busy, slot) for slot in range(3)] + [
        kept_name(code, full, slot) for slot in range(2 + SPARE_SLOTS)]  # the spare slots, no more

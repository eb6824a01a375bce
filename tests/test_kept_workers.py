"""A kept Ray worker's leases without a cluster (resumerge.machine.cluster.keeper): a live run's lease is never
taken, a dead run's is taken back only after its stream stopped (by the next lease or by the watchdog on its own, which
reads that fail otherwise do not stop), a release by another run's token changes nothing, a worker idle for its time
refuses every lease and ends, a worker refuses a run of other code and ends at once where its own code is not its
name's, and one whose stream does not stop in time (or fails to) ends; the code digest follows the files' contents
and every installed distribution's version, not the checkout's path, the files' times or the interpreter's path (on a
copy of the package's tree); ``--keep-workers`` is a length with its unit, 0 keeping none; a run whose node's kept
workers live runs hold leases the next slots, up to the spare ones the cluster's free memory allows, every node's
answers within one deadline (a worker made for the lease within a shorter one from its ask; one that did not answer
killed); ending kept workers kills those whose release did not answer, and all of them on a fallback. The kept
workers on a real cluster: tests/test_ray_executor.py."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import resumerge
from resumerge.api.flagmap import executor_option, keep_option
from resumerge.cli.commands import main
from resumerge.config.settings import KEEP_WORKERS
from resumerge.errors import UsageError
from resumerge.machine.cluster import keeper, kept, launch
from resumerge.machine.cluster.keeper import OTHER_CODE, Keeper, code_digest, installed, run_digest
from resumerge.machine.cluster.kept import SPARE_SLOTS, kept_name
from resumerge.machine.cluster.launch import Worker
from resumerge.merge.engine.cluster import STREAM

# The runtime_env of the fake Ray's jobs.
_CONTEXT = SimpleNamespace(runtime_env={"env_vars": {"HF_HOME": "/hf"}})


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

    ray = SimpleNamespace(get=get, exceptions=SimpleNamespace(ObjectLostError=OwnerDied, GetTimeoutError=TimeoutError),
                          get_runtime_context=lambda: _CONTEXT)
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


def _kept(keep: float = 60.0, named: str | None = None) -> tuple[Keeper, list[str]]:
    renewed: list[str] = []
    _MADE.append(Keeper(keep, lambda: renewed.append("renewed"), _code() if named is None else named))
    return _MADE[-1], renewed


def _code() -> str:
    return run_digest(SimpleNamespace(get_runtime_context=lambda: _CONTEXT))


def _ended(ended: list[str]) -> None:
    deadline = time.monotonic() + 5
    while not ended:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_live_runs_lease_is_never_taken_and_a_dead_ones_only_after_its_stream_stopped(fake_ray: list[str]) -> None:
    worker, renewed = _kept()
    code, first, second = _code(), _Token("first"), _Token("second")
    assert worker.lease([first], code, 60.0) == 0 and renewed == ["renewed"]
    assert worker.lease([second], code, 60.0) is None  # the first run's driver lives
    worker.release([_Token("other")])  # not its lease: nothing changes
    assert worker.holder is first and renewed == ["renewed"]
    first.dead = True  # the first run's driver died: the next lease stops its stream, then serves
    assert worker.lease([second], code, 60.0) == 1 and renewed == ["renewed"] * 2
    worker.release([second])
    assert worker.holder is None and renewed == ["renewed"] * 3


def test_the_watchdog_takes_a_dead_runs_lease_back_on_its_own(fake_ray: list[str]) -> None:
    worker, renewed = _kept()
    token = _Token("run")
    assert worker.lease([token], _code(), 60.0) == 0
    time.sleep(0.1)
    assert worker.holder is not None  # its driver lives
    token.broken = True  # reads that fail otherwise: the watchdog goes on watching
    time.sleep(0.1)
    assert worker.holder is not None and worker.watchdog.is_alive()
    token.broken, token.dead = False, True
    deadline = time.monotonic() + 5
    while worker.holder is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert renewed == ["renewed"] * 2 and fake_ray == []  # stopped and fresh, not ended


def test_an_idle_worker_ends_after_its_time_and_refuses_leases_then(fake_ray: list[str]) -> None:
    worker, _ = _kept(keep=60.0)
    token = _Token("run")
    assert worker.lease([token], _code(), 0.1) == 0  # the lease sets the time kept idle after it
    time.sleep(0.3)
    assert fake_ray == []  # leased: never ends
    worker.release([token])
    deadline = time.monotonic() + 5
    while not fake_ray:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert worker.lease([_Token("late")], _code(), 60.0) is None


def test_a_worker_whose_code_is_not_its_names_ends_at_once(fake_ray: list[str]) -> None:
    worker, renewed = _kept(named="0123456789abcdef")  # another node's checkout made the name
    time.sleep(4 * keeper.WATCH_SECONDS)
    assert fake_ray == []  # not before it told the lease that made it (whose run then asks that node no other slot)
    assert worker.lease([_Token("run")], "0123456789abcdef", 60.0) == OTHER_CODE and renewed == []
    _ended(fake_ray)


def test_a_worker_whose_code_is_not_its_names_ends_unasked_too(fake_ray: list[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper, "TELL_SECONDS", 0.1)  # the lease that made it never reached it
    _kept(named="0123456789abcdef")
    _ended(fake_ray)


@pytest.mark.parametrize("stuck", [True, False], ids=["stop-never-returns", "stop-fails"])
def test_a_worker_whose_stream_does_not_stop_in_time_ends(fake_ray: list[str], monkeypatch: pytest.MonkeyPatch,
                                                          stuck: bool) -> None:
    monkeypatch.setattr(keeper, "RENEW_SECONDS", 0.05)
    gate = threading.Event()

    def renew() -> None:
        if stuck:
            gate.wait(5)
        else:
            raise RuntimeError("the pipeline failed to stop")

    worker = Keeper(60.0, renew, _code())
    _MADE.append(worker)
    started = time.monotonic()
    assert worker.lease([_Token("run")], _code(), 60.0) is None and time.monotonic() - started < 2
    _ended(fake_ray)
    gate.set()


def test_a_worker_refuses_a_run_of_other_code(fake_ray: list[str]) -> None:
    worker, renewed = _kept()
    assert worker.lease([_Token("run")], "0123456789abcdef", 60.0) == OTHER_CODE and renewed == []


def test_a_kept_worker_renews_only_what_a_lease_used_and_one_of_other_code_makes_no_stream(
        fake_ray: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor's side: a worker whose code is not its name's answers its lease without making a stream (no engine,
    no torch imported: it ends at once); a lease that made no call leaves the stream as it was (no stop, no fresh
    one, no collection), one that did gets a fresh stream once, on its release."""
    import resumerge.merge.engine.cluster.worker
    from resumerge.machine.cluster.actor import NodeActor

    made: list[_Stream] = []

    class _Stream:
        def __init__(self, shared: object, setup: object) -> None:
            self.stopped = False
            made.append(self)

        def begin(self, shared: object, setup: object) -> None:
            pass

        def stop(self) -> None:
            self.stopped = True

    monkeypatch.setattr(resumerge.merge.engine.cluster.worker, "ShardStream", _Stream)
    other = NodeActor(None, None, 60.0, "0123456789abcdef", stream=STREAM)
    assert other.keeper is not None
    _MADE.append(other.keeper)
    assert other.lease([_Token("run")], "0123456789abcdef", 60.0) == OTHER_CODE and made == []
    _ended(fake_ray)
    actor = NodeActor(None, None, 60.0, _code(), stream=STREAM)
    assert actor.keeper is not None
    _MADE.append(actor.keeper)
    tokens = [_Token(f"run-{n}") for n in range(4)]
    assert actor.lease([tokens[0]], _code(), 60.0) == 0  # a fresh worker's first lease
    actor.release([tokens[0]])  # refused before it computed: nothing used
    assert len(made) == 1 and not made[0].stopped
    assert actor.lease([tokens[1]], _code(), 60.0) == 1
    actor.begin(None, None)  # type: ignore[arg-type]
    actor.release([tokens[1]])  # used: stopped, and a fresh stream for the next lease
    assert len(made) == 2 and made[0].stopped and not made[1].stopped
    assert actor.lease([tokens[2]], _code(), 60.0) == 2 and len(made) == 2  # renewed already on the release
    actor.release([tokens[2]])
    assert actor.lease([tokens[3]], _code(), 60.0) == 3
    actor.stop()  # a run stopped its stream, then its driver died: the next lease renews it
    tokens[3].dead = True
    assert actor.lease([_Token("after")], _code(), 60.0) == 4 and len(made) == 3 and made[1].stopped


def test_the_code_digest_follows_the_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = code_digest()
    assert before == code_digest() and len(before) == 16
    # Equal on every node that runs the same code: another checkout's path, file times and interpreter path do
    # not count (a copy of the package's tree: the installed files are never touched).
    root = Path(resumerge.__file__).parent  # the whole package is digested, wherever this module lies in it
    copy = tmp_path / "elsewhere" / "resumerge"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "__main__.py").write_text((copy / "__main__.py").read_text() + "\n")
    source = copy / Path(keeper.__file__).resolve().relative_to(root)
    monkeypatch.setattr(keeper, "__file__", str(source))
    assert code_digest() != before  # the package's entry point, far from this module's folder
    (copy / "__main__.py").write_text((copy / "__main__.py").read_text()[:-1])
    times = source.stat()
    os.utime(source, ns=(times.st_atime_ns, times.st_mtime_ns + 10**9))
    monkeypatch.setattr(keeper, "__file__", str(source))
    monkeypatch.setattr(sys, "executable", "/elsewhere/bin/python")
    assert code_digest() == before
    source.write_text(source.read_text() + "\n")
    assert code_digest() != before  # a file's content
    monkeypatch.undo()
    site = tmp_path / "site"  # a dependency's own dependency in another version, on the path
    (site / "idna-0.0_other.dist-info").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    assert code_digest() != before
    monkeypatch.undo()
    monkeypatch.setattr(keeper, "__version__", "0.0.0-other")
    assert code_digest() != before
    # The run's digest: the code's and the job's runtime_env (another job's token is not this one's).
    other = SimpleNamespace(runtime_env={"env_vars": {"HF_TOKEN": "another"}})
    assert run_digest(SimpleNamespace(get_runtime_context=lambda: other)) != _code()


def test_the_installed_distributions_are_read_from_their_folders_names(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    # What the distributions' metadata says, read without it (names normalised as the wheel format does).
    assert installed() == {f"{re.sub(r'[-_.]+', '_', d.metadata['Name']).lower()}=={d.version}"
                           for d in importlib.metadata.distributions()}
    before = installed()
    site = tmp_path / "site"
    (site / "Zope.Fake_Thing-1.2.3+local.dist-info").mkdir(parents=True)
    (site / "old_egg.egg-info").mkdir()  # an egg-info's name carries no version: its metadata's is read
    (site / "old_egg.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: old-egg\nVersion: 4.5\n")
    (site / "not-a-distribution").mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site), str(tmp_path / "missing")])
    assert installed() - before == {"zope_fake_thing==1.2.3+local", "old_egg==4.5"}


def test_keep_workers_is_a_length_and_0_keeps_none() -> None:
    assert keep_option(None) == KEEP_WORKERS == 600.0
    assert keep_option("0") == 0.0 and keep_option(0) == 0.0
    assert keep_option("10m") == 600.0 and keep_option("90s") == 90.0 and keep_option(30) == 30.0
    assert keep_option("0.0") == 0.0
    for bad in ("soon", "-1m", -1, "30", "1.5"):
        with pytest.raises(UsageError, match=r"keep.workers"):  # (the API names its parameter)
            keep_option(bad)
    with pytest.raises(UsageError, match=r"keep.workers needs .*executor"):
        executor_option("local", keep_workers="10m")


def test_a_bare_number_of_keep_workers_is_refused_on_the_command_line(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    """``--session``'s grammar would read ``30`` as 30 hours: the command line says to give the unit."""
    assert main(["run", str(tmp_path / "a.yml"), str(tmp_path / "out"), "--executor", "ray",
                 "--keep-workers", "30"]) == 2
    err = capsys.readouterr().err
    assert "--keep-workers 30" in err and "10m" in err and "600s" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


class _Ref:
    """A lease's or a release's answer: a value, ``LATE`` (none within the wait) or ``DIED`` (the actor died)."""

    def __init__(self, value: object) -> None:
        self.value = value


LATE, DIED = "late", "died"


class _Actors:
    """A Ray whose kept workers answer leases as ``answers`` says by name (absent: a new worker, 0 runs served), where
    the kept workers named ``existing`` live and the cluster has ``free`` memory; records the names a run asked
    for, the waits' time limits, the actors killed and the releases sent."""

    def __init__(self, answers: dict[str, object], existing: set[str] = frozenset(), free: float = 1e12) -> None:
        self.answers, self.existing, self.free = answers, existing, free
        self.asked: list[str] = []
        self.waits: list[float] = []
        self.killed: list[str] = []
        self.released: list[str] = []
        self.exceptions = SimpleNamespace(RayError=RuntimeError)

    def put(self, value: str) -> str:
        return value

    def remote(self, cls: type) -> _Actors:
        return self

    def get_runtime_context(self) -> SimpleNamespace:
        return _CONTEXT

    def available_resources(self) -> dict[str, float]:
        return {"memory": self.free}

    def get_actor(self, name: str, namespace: str) -> str:
        if name not in self.existing:
            raise ValueError(name)
        return name

    def options(self, *, name: str, **options: object) -> SimpleNamespace:
        self.asked.append(name)
        return SimpleNamespace(remote=lambda *args, **kwargs: self.actor(name, self.answers.get(name, 0)))

    def actor(self, name: str, answer: object, release: object = None) -> SimpleNamespace:
        def released(box: list[str]) -> _Ref:
            self.released.append(name)
            return _Ref(release)

        return SimpleNamespace(name=name, lease=SimpleNamespace(remote=lambda box, code, keep: _Ref(answer)),
                               release=SimpleNamespace(remote=released))

    def wait(self, refs: list[_Ref], num_returns: int, timeout: float) -> tuple[list[_Ref], list[_Ref]]:
        self.waits.append(timeout)
        return [r for r in refs if r.value != LATE], [r for r in refs if r.value == LATE]

    def get(self, ref: _Ref) -> object:
        if ref.value == DIED:
            raise RuntimeError("the actor died")
        return ref.value

    def kill(self, actor: SimpleNamespace, no_restart: bool) -> None:
        self.killed.append(actor.name)


def _nodes(**cpus: int) -> list[dict[str, object]]:
    return [{"NodeID": node * 16, "Alive": True, "Resources": {"CPU": n, "memory": 1e12}} for node, n in cpus.items()]


def test_a_run_leases_the_next_slots_where_live_runs_hold_a_nodes_kept_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, busy, full = _code(), "a" * 16, "b" * 16
    # Node a: slot 0 held by a live run, slot 1 kept from 3 runs before; node b: every slot held.
    answers: dict[str, object] = {kept_name(code, busy, 0): None, kept_name(code, busy, 1): 3,
                                  **{kept_name(code, full, slot): None for slot in range(2 + SPARE_SLOTS)}}
    ray = _Actors(answers)
    monkeypatch.setattr(kept, "pinned", lambda node_id: None)
    workers, reused, _ = kept.lease(ray, _nodes(a=2, b=2), 1, 60.0, STREAM)  # type: ignore[arg-type]
    assert [w.actor.name for w in workers] == [kept_name(code, busy, slot) for slot in (1, 2)] and reused == 1
    assert {w.token for w in workers} == {code} and {w.width for w in workers} == {1}
    # Every node's slots asked at once (then the spare ones), the spare slots and no more, each round's new workers
    # within a new worker's deadline.
    assert ray.asked == [kept_name(code, busy, 0), kept_name(code, busy, 1), kept_name(code, full, 0),
                         kept_name(code, full, 1), kept_name(code, busy, 2), kept_name(code, full, 2),
                         kept_name(code, full, 3)]
    assert len(ray.waits) == 2 and max(ray.waits) <= kept.NEW_LEASE_SECONDS and ray.killed == []


def test_spare_slots_need_free_memory_and_a_worker_that_does_not_answer_is_killed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    code, full, slow = _code(), "b" * 16, "c" * 16
    # Node b: its slots held, its first spare kept from 2 runs before (no new memory), the next one would be new;
    # node c: its worker never answers (never scheduled); the cluster has no memory free for a new worker.
    answers: dict[str, object] = {kept_name(code, full, 0): None, kept_name(code, full, 1): None,
                                  kept_name(code, full, 2): 2, kept_name(code, slow, 0): LATE}
    ray = _Actors(answers, existing={kept_name(code, full, 2)}, free=0.0)
    monkeypatch.setattr(kept, "pinned", lambda node_id: None)
    workers, reused, _ = kept.lease(ray, _nodes(b=2, c=1), 1, 60.0, STREAM)  # type: ignore[arg-type]
    assert [w.actor.name for w in workers] == [kept_name(code, full, 2)] and reused == 1
    assert ray.asked == [kept_name(code, full, 0), kept_name(code, full, 1), kept_name(code, slow, 0),
                         kept_name(code, full, 2)]
    assert ray.killed == [kept_name(code, slow, 0)]


def test_a_worker_made_for_the_lease_is_waited_for_less_than_a_kept_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new worker that pends (its node's memory held by another run) must not stall the run's start for the
    whole lease deadline: only the kept workers that live are given that long."""
    code, node = _code(), "a" * 16
    live, new = kept_name(code, node, 0), kept_name(code, node, 1)
    # Its spare slots: one a live run holds, one whose worker runs other code (counted: the run says so).
    spares = {kept_name(code, node, 2): None, kept_name(code, node, 3): OTHER_CODE}
    ray = _Actors({live: LATE, new: LATE, **spares}, existing={live})
    monkeypatch.setattr(kept, "pinned", lambda node_id: None)
    assert kept.lease(ray, _nodes(a=2), 1, 60.0, STREAM) == ([], 0, 1)  # type: ignore[arg-type]
    assert ray.waits[0] <= kept.NEW_LEASE_SECONDS < kept.LEASE_SECONDS - 1 < ray.waits[1]
    assert ray.killed == [live, new]


def test_ending_kills_a_kept_worker_whose_release_does_not_answer_and_every_one_on_a_fallback() -> None:
    ray = _Actors({})
    fresh, answers, late, died = (Worker(ray.actor(name, 0, release), name, name, 1, token=None if name == "fresh"
                                         else "token") for name, release in
                                  (("fresh", None), ("answers", None), ("late", LATE), ("died", DIED)))
    launch.end(ray, [fresh, answers, late, died])  # type: ignore[arg-type]
    assert ray.released == ["answers", "late", "died"] and ray.killed == ["fresh", "late"]
    ray.released.clear()
    ray.killed.clear()
    launch.end(ray, [fresh, answers], kill=True)  # type: ignore[arg-type]
    assert ray.released == [] and ray.killed == ["fresh", "answers"]

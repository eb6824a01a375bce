"""A Ray run's warm start (resumerge.merge.engine.cluster.warm) without a cluster: closing it never waits for a start
under way, and every worker placed is ended once; a recipe's later stage leases again the kept workers the stages before
held, and the call's end releases the others (kills them on a second Ctrl-C meanwhile); a run stopped during the
start takes nothing at once; a start that fails (an import included) takes nothing and leaves no worker; its thread
imports no module of resumerge; a resume starts none for a plan recorded on a GPU, nor for one whose device only the
hub's manifest says."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resumerge.api.options import recorded_device, started_early
from resumerge.config.locations import RunLocations, StateDir
from resumerge.config.settings import RunSettings
from resumerge.machine import rayconnect as connect
from resumerge.machine.cluster import kept, launch
from resumerge.merge.engine.cluster.warm import WarmStart
from resumerge.merge.engine.executors import RayExecutor
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import MANIFEST_NAME, Manifest


@pytest.fixture
def placing(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event, list[list[str]]]:
    """A cluster of no node whose placement, once begun (the first event), waits for the second, then places two
    workers; the lists of workers ended are recorded."""
    begun, go, ended = threading.Event(), threading.Event(), []

    def place(*args: Any, **kwargs: Any) -> list[str]:
        begun.set()
        go.wait(5)
        return ["w1", "w2"]

    monkeypatch.setattr(connect, "require_ray", lambda: SimpleNamespace(nodes=lambda: []))
    monkeypatch.setattr(launch, "place", place)
    monkeypatch.setattr(launch, "end", lambda ray, workers: ended.append(list(workers)))
    return begun, go, ended


@pytest.fixture
def stalled(placing: tuple[threading.Event, threading.Event, list[list[str]]]
            ) -> tuple[WarmStart, threading.Event, list[list[str]]]:
    """A warm start whose placement has begun and waits for the event returned; the lists of workers ended."""
    begun, go, ended = placing
    warm = WarmStart(None, 1)
    assert begun.wait(5)
    return warm, go, ended


def test_close_does_not_wait_for_the_start_which_ends_what_it_places_after(
        stalled: tuple[WarmStart, threading.Event, list[list[str]]]) -> None:
    warm, go, ended = stalled
    began = time.monotonic()
    warm.close()  # the run failed fast: the placement is still under way
    assert time.monotonic() - began < 1 and ended == []
    go.set()
    warm.thread.join(5)
    assert ended == [["w1", "w2"]] and warm.take() == []


def test_close_ends_the_workers_placed_and_not_taken_once(
        placing: tuple[threading.Event, threading.Event, list[list[str]]]) -> None:
    _, go, ended = placing
    go.set()
    warm = WarmStart(None, 1)
    warm.joined()
    warm.close()
    warm.close()
    assert ended == [["w1", "w2"]]


def test_a_recipes_later_stage_leases_again_the_kept_workers_an_earlier_one_held_and_the_call_releases_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Released, then leased again with a fresh token: the same processes, each with a fresh stream."""
    calls: list[tuple[str, list[str], bool]] = []
    leases = iter([(["k1", "k2"], 0, 0), (["k1", "k2"], 2, 1)])

    def lease(ray: Any, nodes: Any, threads: int, keep: float, stream: str) -> tuple[list[str], int, int]:
        calls.append(("lease", [], False))
        return next(leases)

    monkeypatch.setattr(connect, "require_ray", lambda: SimpleNamespace(nodes=lambda: []))
    monkeypatch.setattr(kept, "lease", lease)
    monkeypatch.setattr(launch, "end", lambda ray, workers, kill=False: calls.append(("end", list(workers), kill)))
    warm = WarmStart(None, 1, keep=60.0)
    assert warm.take() == ["k1", "k2"] and (warm.reused, warm.other) == (0, 0)
    warm.hold(["k1", "k2"])  # the first stage's run ended: still leased
    assert calls == [("lease", [], False)]
    # A later stage: released, then leased again (one worker of another runtime_env refused).
    assert warm.take() == ["k1", "k2"] and (warm.reused, warm.other) == (2, 1)
    assert calls[1:] == [("end", ["k1", "k2"], False), ("lease", [], False)]
    del calls[:]
    warm.hold(["k3"])
    warm.close()  # the call ends: released for the next run
    warm.hold(["k4"])  # (a run that hands its workers back after the call ended releases them itself)
    assert calls == [("end", ["k3"], False), ("end", ["k4"], False)]


def test_a_second_ctrl_c_while_the_call_releases_its_kept_workers_kills_them(monkeypatch: pytest.MonkeyPatch) -> None:
    ended: list[tuple[list[str], bool]] = []

    def end(ray: Any, workers: list[str], kill: bool = False) -> None:
        ended.append((list(workers), kill))
        if not kill:
            raise KeyboardInterrupt

    monkeypatch.setattr(connect, "require_ray", lambda: SimpleNamespace(nodes=lambda: []))
    monkeypatch.setattr(kept, "lease", lambda ray, nodes, threads, keep, stream: (["k1"], 0, 0))
    monkeypatch.setattr(launch, "end", end)
    warm = WarmStart(None, 1, keep=60.0)
    warm.hold(warm.take())
    with pytest.raises(KeyboardInterrupt):
        warm.close()
    assert ended == [(["k1"], False), (["k1"], True)]
    del ended[:]  # a run that hands its workers back after the call ended: the same guard
    with pytest.raises(KeyboardInterrupt):
        warm.hold(["k2"])
    assert ended == [(["k2"], False), (["k2"], True)]


def test_a_run_stopped_while_the_start_is_under_way_takes_nothing_at_once(
        stalled: tuple[WarmStart, threading.Event, list[list[str]]]) -> None:
    """A Ctrl-C during a stalled lease stops the run at once; the call's close then ends what the start places."""
    warm, go, ended = stalled
    began = time.monotonic()
    assert warm.take(lambda: True, 0.01) == [] and time.monotonic() - began < 1
    warm.close()
    go.set()
    warm.thread.join(5)
    assert ended == [["w1", "w2"]]


def test_a_resume_reads_the_recorded_device_before_starting_warm_workers(tmp_path: Path) -> None:
    out, state = tmp_path / "out", tmp_path / "state"
    ray = RunSettings(state=StateDir.resolve(state), executor=RayExecutor())
    assert recorded_device(out, ray) == "cpu"  # nothing recorded
    path = RunLocations.of(out, state).ledger
    path.parent.mkdir(parents=True)
    for device in ("cpu", "cuda:0"):
        ledger = Ledger(path)
        plan = Manifest(version="0", fingerprint="f", parts={}, inputs={}, options={"device": device}, model_dirs={},
                        config_text="", planned=())
        ledger.start_run(str(out), "merge", plan, files=(), tensors=())
        ledger.close()
        assert recorded_device(out, ray) == device
    assert recorded_device(out, RunSettings(state=StateDir.resolve(state))) == "cpu"  # a local run starts none anyway
    with started_early(ray, out, recorded_device(out, ray)) as settings:
        assert isinstance(settings.executor, RayExecutor) and settings.executor.early is None


_IMPORTS = """
import sys, threading, types
from resumerge.merge.engine.cluster.warm import WarmStart

assert not [m for m in sys.modules if m.startswith(("resumerge.merge.engine.executor",
                                                      "resumerge.merge.engine.cluster.worker",
                                                      "resumerge.merge.plan"))], "the warm start imports the engine"

imported = []


class Seen:  # asked first for every module imported from now on: records the warm start's thread's
    @staticmethod
    def find_spec(name, path=None, target=None):
        if threading.current_thread().name == "resumerge-ray-warm-start":
            imported.append(name)


def nodes():
    import colorsys  # a module nothing here has imported yet: the record sees the thread's imports
    return []


# A Ray of no node (the placement raises, as on a cluster without one): the thread's whole path runs.
fake = {"ray": types.SimpleNamespace(nodes=nodes, remote=lambda cls: cls, is_initialized=lambda: True,
                                     put=lambda value: value),
        "ray.util.scheduling_strategies": types.SimpleNamespace(NodeAffinitySchedulingStrategy=None)}
sys.modules.update(fake)
sys.meta_path.insert(0, Seen)
for keep in (0.0, 600.0):  # workers that end with the run, and kept ones leased
    imported.clear()
    warm = WarmStart(None, 1, keep)
    assert warm.take() == [] and "colorsys" in imported, imported
    assert not [m for m in imported if m.startswith("resumerge")], f"the warm start's thread imports {imported}"
    del sys.modules["colorsys"]
sys.meta_path.remove(Seen)
for name in fake:
    del sys.modules[name]
import resumerge.merge.engine.cluster.worker
assert "huggingface_hub" not in sys.modules and "resumerge.inputs.hub" not in sys.modules, "a worker imports the hub"
assert "sqlite_utils" not in sys.modules and "resumerge.merge.store.ledger" not in sys.modules, \
    "a worker imports the ledger"
"""


def test_the_warm_start_places_workers_without_the_engine_and_a_worker_imports_no_hub() -> None:
    # The warm start's thread places the workers as soon as it has joined, beside the planning thread (sharing its
    # GIL): the actor's class brings nothing of the engine. That thread imports no module of resumerge at all: the
    # planning thread imports packages that import their modules eagerly (methods, moe, vocab, inputs' codecs,
    # adapters and hub), and CPython can fail one of two threads that import one package tree at once. A worker of
    # a run that streams no hub input and uploads nothing never imports the hub's stack (a second of its start,
    # before its first shard), and no worker imports the ledger (sqlite-utils): the driver alone journals.
    result = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_resume_from_the_manifest_alone_starts_warm_workers_only_for_a_device_known_here(tmp_path: Path) -> None:
    ray = RunSettings(state=StateDir.resolve(tmp_path / "state"), executor=RayExecutor())  # no ledger in it
    out = tmp_path / "out"
    out.mkdir()
    for device in ("cpu", "cuda:0"):  # OUT's manifest is read here: a folder
        manifest = Manifest(version="0", fingerprint="f", parts={}, inputs={}, options={"device": device},
                            model_dirs={}, config_text="", planned=())
        (out / MANIFEST_NAME).write_bytes(manifest.to_bytes())
        assert recorded_device(out, ray) == device
    # An hf:// OUT's manifest is on the hub, which the resume itself reads: no device known before, no warm start
    # (a cluster is named: one would start for a CPU run).
    assert recorded_device("hf://alice/merged", ray) is None
    with started_early(replace(ray, executor=RayExecutor(address="127.0.0.1:9")), "hf://alice/merged",
                       recorded_device("hf://alice/merged", ray)) as settings:
        assert isinstance(settings.executor, RayExecutor) and settings.executor.early is None


class _Actors:
    """Ray's actor class as :func:`~resumerge.machine.cluster.launch.place` uses it: the second actor made
    raises."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def options(self, **declared: Any) -> _Actors:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> str:
        if self.made:
            raise RuntimeError("the raylet refused the actor")
        self.made.append("w1")
        return "w1"


@pytest.mark.parametrize("failing", ["import", "placement"])
def test_a_start_that_fails_only_loses_the_head_start_and_leaves_no_worker(
        monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    # Whatever fails in the thread (Ray's import, as a concurrent import's ImportError or _DeadlockError would, or
    # the placement half way), the run takes no worker and starts its own, as a run without a warm start does; a
    # worker placed before the failure is ended by the placement itself, and by nothing else.
    ended: list[list[str]] = []
    nodes = [{"NodeID": node, "Alive": True, "Resources": {"CPU": 1.0}} for node in ("a" * 16, "b" * 16)]
    fake = SimpleNamespace(nodes=lambda: nodes, remote=lambda cls: _Actors(), kill=None)

    def require_ray() -> SimpleNamespace:
        if failing == "import":
            raise ImportError("cannot import name 'util' from partially initialized module 'ray'")
        return fake

    monkeypatch.setattr(connect, "require_ray", require_ray)
    monkeypatch.setattr(launch, "end", lambda ray, workers: ended.append([w.actor for w in workers]))
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", SimpleNamespace(
        NodeAffinitySchedulingStrategy=lambda node, soft: node))
    warm = WarmStart(None, 1)
    warm.joined()
    assert not warm.thread.is_alive() and warm.take() == []
    warm.close()
    assert ended == ([] if failing == "import" else [["w1"]])


def test_a_hub_run_under_max_disk_starts_warm_only_where_its_workers_are_kept(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept workers declare no CPU, so they serve the width the plan's shard size sets (launch.fit): a hub run under
    --max-disk on a cluster that outlives it starts warm; workers that end with the run declare their CPUs as they
    start, so it starts those once it has planned. A GPU run starts none warm either way."""

    def no_ray() -> None:
        raise ImportError("no Ray here")  # the start's thread ends at once: only the decision is tested

    monkeypatch.setattr(connect, "require_ray", no_ray)
    settings = RunSettings(state=StateDir.resolve(tmp_path / "state"))
    for keep, device, warm in ((600.0, "cpu", True), (0.0, "cpu", False), (600.0, None, False)):
        with RayExecutor("head:6379", keep_workers=keep).starting(settings, device=device, bounded=True) as started:
            assert isinstance(started, RayExecutor) and (started.early is not None) is warm, (keep, device)

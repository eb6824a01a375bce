"""Every pass's object on a Ray node is made one way (issue 83): a model of a check, measurement, evaluation or the
MoE gates (:class:`~resumerge.forward.placing.modelnode.ModelNode`) and a search's group of candidates
(:class:`~resumerge.runs.evolve.spread.NodeScores`) are hosted by the kept workers' own host
(:class:`~resumerge.machine.cluster.hostcalls.Hosting`), in a kept worker or, where none is kept, in a fresh
actor of it pinned to the node (:func:`~resumerge.forward.placing.onray.on_place`): the one Ray actor class of every
pass. Without a cluster: a stand-in for Ray that runs each actor in this process and records what was asked of it. The
same passes on a real cluster: tests/test_ray_passes.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from raystandin import StandInRay

from resumerge.errors import UnreachableError, UsageError
from resumerge.machine.cluster.hostcalls import Hosting

NODES = [{"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 2.0, "memory": 8e9}},
         {"NodeID": "b" * 56, "Alive": True, "Resources": {"CPU": 4.0, "memory": 8e9}},
         {"NodeID": "c" * 56, "Alive": False, "Resources": {"CPU": 8.0, "memory": 8e9}}]


class _Ray(StandInRay):
    """What the passes ask of Ray: each actor made and called in this process (a call's result its own reference),
    every class made an actor of and the options it was made with recorded, and the actors killed."""

    def __init__(self, nodes: Sequence[dict[str, Any]] = NODES) -> None:
        self.listed = list(nodes)
        self.made: list[tuple[type, dict[str, Any]]] = []
        self.killed: list[object] = []

    def remote(self, cls: type) -> Any:
        made = self.made

        class _Options:
            def options(self, **options: Any) -> Any:
                return SimpleNamespace(remote=lambda *args: made.append((cls, options)) or _Actor(cls(*args)))

        return _Options()

    def nodes(self) -> list[dict[str, Any]]:
        return self.listed

    def kill(self, actor: object, no_restart: bool = True) -> None:
        self.killed.append(actor)


class _Actor:
    """An actor of the stand-in: ``actor.method.remote(...)`` calls its object's method now."""

    def __init__(self, made: object) -> None:
        self.made = made

    def __getattr__(self, name: str) -> object:
        return SimpleNamespace(remote=getattr(self.made, name))


def _made_as_one_host(ray: _Ray, nodes: Sequence[str], cpus: Sequence[float]) -> None:
    """Every actor ``ray`` made is a :class:`Hosting`, pinned to ``nodes`` declaring ``cpus`` in that order, and
    every one was killed as its pass ended."""
    assert [cls for cls, _ in ray.made] == [Hosting] * len(nodes)
    assert [options["scheduling_strategy"].node_id for _, options in ray.made] == list(nodes)
    assert [options["num_cpus"] for _, options in ray.made] == list(cpus)
    assert all(options["max_restarts"] == 0 for _, options in ray.made)
    assert len(ray.killed) == len(nodes)


class _Model:
    """A model's object on its node, in place of :class:`~resumerge.forward.placing.modelnode.ModelNode`: its calls
    logged."""

    def __init__(self, model: object, threads: int, *rest: object) -> None:
        self.log = [f"made {model} on {threads} thread(s)"]

    def node(self) -> str:
        return "node"

    def enter(self, batches: list[object]) -> tuple[list[object], frozenset[int]]:
        self.log.append("enter")
        return ["h"], frozenset()  # (no layer whose input the forward computes)

    def layer(self, index: int, own: object, same: object) -> tuple[object, object, dict[str, object], object]:
        self.log.append(f"layer {index}")
        return [f"out {index}"], None, {}, None


def test_a_pass_s_models_are_hosted_by_fresh_actors_of_the_kept_workers_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.forward.placing import rayactor
    from resumerge.forward.placing.onray import Place
    from resumerge.inputs.kernels import kernel_threads

    monkeypatch.setattr(rayactor, "ModelNode", _Model)
    monkeypatch.setattr(rayactor, "sent", lambda model: model.name)
    ray = _Ray()
    models = [SimpleNamespace(name=name, remote=()) for name in ("merge", "parent")]
    with kernel_threads(3):  # the pass's recorded count, as its driver computes with it (forward.threads)
        running = rayactor.RayModels(ray, models, [Place("a" * 56, 2.0, 1 << 30), Place("b" * 56, 1.0, 1 << 30)], 2)
    running.start()
    try:
        assert running.enter([]) == [["h"], ["h"]]
        own, _ = running.layer(0, [["h"], ["h"]], None)
        assert own == [["out 0"], ["out 0"]]
    finally:
        running.end()
    # each declares its place's CPUs to Ray, and computes with the pass's count, whatever it declares
    _made_as_one_host(ray, ["a" * 56, "b" * 56], [2.0, 1.0])
    assert all(options["memory"] == 1 << 30 for _, options in ray.made)
    hosted = [actor.worker.actor.made.hosted for actor in running.actors]
    assert [each.log for each in hosted] == [["made merge on 3 thread(s)", "enter", "layer 0"],
                                            ["made parent on 3 thread(s)", "enter", "layer 0"]]
    told = rayactor.RayModels(_Ray(), models, [Place("a" * 56, 2.0, 0)], 2, terms=rayactor.ActorTerms(threads=5))
    assert told.threads == [5]


class _Scorer:
    """A search's scorer working in ``folder``: each candidate's figure its config's ``x``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        found = []
        for k, config in enumerate(configs):
            figures = done(k) or {"kl": float(config["x"]), "where": float(len(self.folder.name))}
            record(k, figures)
            found.append(figures)
        return found


def _spread(store: Path, ray: _Ray, monkeypatch: pytest.MonkeyPatch) -> Any:
    import resumerge.machine.rayconnect as connect
    from resumerge.runs.evolve.spread import SpreadOverNodes

    monkeypatch.setattr(connect, "join", lambda address: ray)
    monkeypatch.setattr(connect, "require_ray", lambda: ray)
    return SpreadOverNodes(_Scorer, store, None, say=lambda **said: None)


def test_a_search_s_groups_of_candidates_are_hosted_as_a_pass_s_models_are(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.runs.evolve import storage

    ray = _Ray()
    spread = _spread(tmp_path, ray, monkeypatch)
    recorded: dict[int, dict[str, float]] = {}
    configs = [{"x": x} for x in range(5)]
    storage.journal(tmp_path, 1, 3, {"kl": 30.0, "where": 0.0})  # a killed search journaled it: not scored again
    found = spread.score(1, configs, lambda i: None, recorded.__setitem__)
    # Two groups of neighbours, the first (three candidates) on the node with the most CPUs, on all of them.
    _made_as_one_host(ray, ["b" * 56, "a" * 56], [4.0, 2.0])
    assert [f["kl"] for f in found] == [0.0, 1.0, 2.0, 30.0, 4.0]
    assert recorded == dict(enumerate(found))
    assert [f["where"] for f in found[:3]] == [len("generation-0001-group-0-1-2")] * 3
    assert storage.journaled(tmp_path, 1, 4) == found[4]


def test_a_search_on_a_cluster_without_cpus_or_that_loses_a_node_says_so(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spread = _spread(tmp_path, _Ray([{"NodeID": "a" * 56, "Alive": True, "Resources": {"CPU": 0}}]), monkeypatch)
    with pytest.raises(UsageError, match="no node with CPUs") as none:
        spread.score(0, [{"x": 1}], lambda i: None, lambda i, f: None)
    assert none.value.exit_code == 2

    class _Lost(_Ray):
        def get(self, refs: object) -> object:
            raise self.exceptions.RayError("the node died")

    ray = _Lost()
    spread = _spread(tmp_path, ray, monkeypatch)
    with pytest.raises(UnreachableError, match=r"a Ray node scoring the search's candidates was lost \(RayError\)"):
        spread.score(0, [{"x": 1}, {"x": 2}], lambda i: None, lambda i, f: None)
    assert len(ray.killed) == 2  # its actors ended all the same

"""A pass's node-side watch (:class:`~resumerge.forward.job.placement.NodeWatch`, issue 83): ``measure``'s Grams are
computed where each model's layer runs, by this process's :class:`~resumerge.forward.job.placement.Streams` or by the
forward engine's one Ray actor (:class:`~resumerge.forward.placing.modelnode.ModelNode`, here in this process behind a
stand-in for Ray) on a copy of the watch sent to it; the driver writes and journals them alike, so the two write the
same bytes and a measurement started on one resumes on the other."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from raystandin import StandInRay
from support import one_thread

from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)
TOKENS = [[1, 5, 9, 13, 2], [3, 4, 5], [7, 8, 9, 10, 11, 12, 2]]


class _Actor:
    """A ModelNode called as the driver calls a Ray actor (``actor.method.remote(...)``), its arguments and
    results pickled as Ray sends them."""

    def __init__(self, node: object) -> None:
        self._node = node

    def __getattr__(self, name: str) -> object:
        method = getattr(self._node, name)

        def remote(*args: object) -> object:
            return pickle.loads(pickle.dumps(method(*pickle.loads(pickle.dumps(args)))))

        return SimpleNamespace(remote=remote)


def _model(tmp_path: Path) -> Any:
    from dataclasses import replace

    from resumerge.config.locations import StateDir
    from resumerge.forward.opening.opened import open_for_pass

    folder = make_model(tmp_path / "model", SPEC, seed=3)
    return replace(open_for_pass(folder, "model", StateDir.resolve(tmp_path / "s")), role="model")


def _here(model: Any, out: Path, journal: Path) -> None:
    from resumerge.analyses.measure.grams import GramWatch, measure_model, tokens_of
    from resumerge.analyses.measure.passes import stream_of
    from resumerge.forward.job.placement import Streams
    from resumerge.forward.text.batches import one_by_one

    batches = one_by_one(TOKENS)
    with one_thread(), stream_of(model, "model") as stream:  # as the actor computes: float32 sums round alike
        watch = GramWatch(tokens_of(batches))
        measure_model(Streams([stream], watch=watch, rows=False), watch, batches, out, 0, journal)


def _on_node(model: Any, out: Path, journal: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The model measured on its actor; the watches the actor computed with."""
    import resumerge.machine.rayconnect
    from resumerge.analyses.measure.grams import GramWatch, measure_model, tokens_of
    from resumerge.forward.placing.modelnode import ModelNode
    from resumerge.forward.placing.onray import Place, sent
    from resumerge.forward.placing.rayactor import ActorTerms, RayModels
    from resumerge.forward.text.batches import one_by_one

    monkeypatch.setattr(resumerge.machine.rayconnect, "this_node", lambda: "0123abcd")
    batches = one_by_one(TOKENS)
    watch = GramWatch(tokens_of(batches))
    node = ModelNode(sent(model), 1, what="measure", watch=pickle.loads(pickle.dumps(watch)))  # as Ray sends it
    running = RayModels(StandInRay(), [model], [Place("node", 1.0, 0)], SPEC.layers, terms=ActorTerms(watch=watch))
    running.actors, running.nodes = [_Actor(node)], ["node"]  # as start() leaves them, the actor in this process
    try:
        with one_thread():  # the driver's (the actor computes each call on the one thread it was made with)
            measure_model(running, watch, batches, out, 0, journal)
    finally:
        node.close()
    return [node.watch, watch]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))}


def test_grams_computed_on_the_node_are_the_bytes_computed_here(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path)
    _here(model, tmp_path / "here", tmp_path / "j-here")
    node_watch, driver_watch = _on_node(model, tmp_path / "node", tmp_path / "j-node", monkeypatch)
    here = _files(tmp_path / "here")
    assert len(here) == SPEC.layers and _files(tmp_path / "node") == here
    # the node's copy of the watch computed them and gave them up; the driver's only passed them to the step
    assert node_watch is not driver_watch and node_watch.found == {} and driver_watch.found == {}


def test_a_measurement_stopped_here_resumes_on_the_node_with_the_same_bytes(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from resumerge.forward.job import layerpass

    model = _model(tmp_path)
    _here(model, tmp_path / "whole", tmp_path / "j-whole")

    class Stopped(Exception):
        pass

    def stop_after_layer_1(point: str, run_pid: int | None = None) -> None:
        if (tmp_path / "both" / "model-00" / "layer-00001.safetensors").is_file():
            raise Stopped

    with monkeypatch.context() as patched:
        patched.setattr(layerpass, "reach", stop_after_layer_1)
        with pytest.raises(Stopped):
            _here(model, tmp_path / "both", tmp_path / "j-both")
    (tmp_path / "both" / "model-00" / "layer-00000.safetensors").unlink()  # journaled past it: not written again
    _on_node(model, tmp_path / "both", tmp_path / "j-both", monkeypatch)
    assert not (tmp_path / "both" / "model-00" / "layer-00000.safetensors").exists()
    whole = _files(tmp_path / "whole")
    assert _files(tmp_path / "both") == {k: v for k, v in whole.items() if "00000" not in k}


def test_an_actor_computes_with_the_pass_s_count_not_the_cpus_it_declares(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass's actors compute with the count the pass's driver recorded and computes with (forward.threads), not
    with the CPUs each declares to Ray: an actor declaring four computes its layers on one thread under a one-thread
    pass, and writes the bytes of that pass run here (it computed on four before, whatever the pass recorded)."""
    import torch

    import resumerge.machine.rayconnect
    from resumerge.analyses.measure.grams import GramWatch, measure_model, tokens_of
    from resumerge.forward.placing import modelnode, rayactor
    from resumerge.forward.placing.onray import Place
    from resumerge.forward.text.batches import one_by_one
    from resumerge.inputs.kernels import kernel_threads

    model = _model(tmp_path)
    _here(model, tmp_path / "here", tmp_path / "j-here")
    seen: list[int] = []
    layer = modelnode.model_layer

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return layer(*args, **kwargs)

    made: list[Any] = []

    def on_place(ray: object, place: object, host: object, factory: Any, *args: object) -> _Actor:
        made.append(factory(*pickle.loads(pickle.dumps(args))))  # as Ray sends the terms
        return _Actor(made[-1])

    monkeypatch.setattr(resumerge.machine.rayconnect, "this_node", lambda: "0123abcd")
    monkeypatch.setattr(modelnode, "model_layer", counted)
    monkeypatch.setattr(rayactor, "on_place", on_place)
    monkeypatch.setattr(rayactor, "kept_hosts", lambda ray, places, keep, stream: [None] * len(places))
    monkeypatch.setattr(rayactor, "end_actors", lambda ray, actors, hosts: None)
    batches = one_by_one(TOKENS)
    watch = GramWatch(tokens_of(batches))
    with one_thread(), kernel_threads(1):  # the pass's recorded count, as its driver computes with it
        running = rayactor.RayModels(StandInRay(), [model], [Place("node", 4.0, 0)], SPEC.layers,
                                     terms=rayactor.ActorTerms(what="measure", watch=watch))
        running.start()
        try:
            measure_model(running, watch, batches, tmp_path / "node", 0, tmp_path / "j-node")
        finally:
            running.end()
            made[0].close()
    assert seen == [1] * SPEC.layers
    assert _files(tmp_path / "node") == _files(tmp_path / "here")

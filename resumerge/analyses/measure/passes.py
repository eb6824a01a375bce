"""A measurement's passes, once every check is made (:mod:`.run`): each model's (or RegMean++'s merged one) on the
forward engine's one journaled layer pass (:mod:`.grams`), journaled under the state dir (``measures/<key>``), each
layer admitted by the RAM governor, a hub model's ranges held to the hub's checksums
(:class:`~resumerge.forward.opening.hubreads.PassReads`): on Ray, this process reads each range a node read too, so that
each hub file the pass reads whole is proved against the hub's checksum here, as a local measurement proves it; then
``measure.json`` with each file's sha256, written last."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.errors import UsageError
from resumerge.forward.opening.opened import PassModel
from resumerge.inputs.grams import (
    MANIFEST,
    METADATA_KEY,
    GramRef,
    MeasuredModel,
    Measurement,
    layer_file,
    model_folder,
)
from resumerge.inputs.grams import sha256_of as sha256_of
from resumerge.inputs.safetensors_format import read_header

if TYPE_CHECKING:
    from resumerge.analyses.measure.grams import GramWatch
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.forward.job.layerpass import Reserve
    from resumerge.forward.job.placement import Placement
    from resumerge.forward.opening.hubreads import PassReads
    from resumerge.forward.placing.onray import Read
    from resumerge.forward.placing.sites import PassSite, Seats
    from resumerge.forward.text.batches import Batch
    from resumerge.machine.torch_import import torch

JOURNAL = ".journal"  # where a measurement of an earlier version journaled, inside OUT_DIR (moved on resume)
HIDDEN = "journal"  # the hidden states' journal, in the measurement's folder under the state dir
RATIO_KEY = "reduce_non_diagonal_ratio"

# (checkpoint name, each model's value in float32, each model's Gram of that linear's input or None) -> merged value
LayerMerge = Callable[[str, "list[torch.Tensor]", "list[torch.Tensor] | None"], "torch.Tensor"]


def workdir_of(folder: Path, workdir: Path) -> Path:
    """The measurement's folder under the state dir, ``workdir``; a journal an earlier version kept inside OUT_DIR
    (``.journal``) moved there first, so a measurement it was killed in resumes at the layer it reached (the same
    files, the same names)."""
    old = folder / JOURNAL
    if old.is_dir():
        if not (workdir / HIDDEN).exists():
            workdir.mkdir(parents=True, exist_ok=True)
            shutil.move(str(old), str(workdir / HIDDEN))
        else:
            shutil.rmtree(old, ignore_errors=True)  # the state dir's journal is the newer one
    return workdir


def stream_of(model: PassModel, key: str, device: str = "cpu") -> ModelStream:
    """``model``'s modules without weights, read in float32 as the pass runs (a hub model's by range), each layer
    run on ``device``."""
    from resumerge.forward.engine.reader import Weights
    from resumerge.forward.engine.stream import ModelStream
    from resumerge.machine.torch_import import torch

    return ModelStream(Weights.of(model.opened.directory, model.opened.tensors, model.remote, model.reads),
                       model.opened.config, torch.float32, what="resumerge measure", key=key, device=device)


@dataclass(frozen=True)
class Measuring:
    """A measurement's passes as they run: its ``models`` (bound to the hub reads' journal ``reads``), their
    ``keys``, the ``batches``, OUT_DIR (``folder``), the journal's folder (``workdir``) and what it tells of its
    progress."""

    models: list[PassModel]
    keys: list[str]
    batches: list[Batch]
    folder: Path
    workdir: Path
    on_progress: Callable[[str], None] | None
    reads: PassReads


@dataclass(frozen=True)
class Placed:
    """Where the executor placed a measurement's models: its ``site`` (:mod:`resumerge.forward.placing.sites`) and their
    ``seats`` there, each model's pass (``layers``: each model's decoder layers) a placement of its own
    (:meth:`~resumerge.forward.placing.sites.Seats.each`: one after another in this process, side by side on a Ray
    cluster's actors), each layer run on ``device`` there. The Grams are written and the hidden states journaled
    by this process alike, so the bytes are the same whichever ran them."""

    site: PassSite
    seats: Seats
    layers: list[int]
    device: str = "cpu"


def run_measurement(models: list[PassModel], keys: list[str], tokens: list[list[int]], folder: Path, workdir: Path,
                    on_progress: Callable[[str], None] | None, merged: dict[str, object] | None,
                    reserve: Reserve, placed: Placed) -> tuple[Measurement, list[MeasuredModel]]:
    """Every model's Grams into ``folder`` (journaled in ``workdir``; each layer run on ``placed.device``), then
    ``measure.json``; the measurement. ``placed``: where the models' passes run (:class:`Placed`); RegMean++'s
    merged pass (``merged``) runs here, every model's layer merged in one place."""
    from resumerge.forward.opening.hubreads import PassReads
    from resumerge.forward.text.batches import one_by_one
    from resumerge.machine.durable import write_file_atomic
    from resumerge.machine.memory.allocator import tune_allocator
    from resumerge.merge.store.ledger import Ledger

    batches = one_by_one(tokens)  # one sequence a batch: a Gram sums over every position it is given
    reads = PassReads(workdir, Ledger)
    # On Ray this process reads each byte the nodes read once, for its file's proof: it keeps none for a second read.
    models = placed.site.bind(reads, models, fresh=not (workdir / HIDDEN).exists())
    restore = tune_allocator()
    measured: list[MeasuredModel] = []
    error: BaseException | None = None
    try:
        if merged is not None:
            ratio = merged[RATIO_KEY]
            assert isinstance(ratio, float)
            measured = _run_merged(models, keys, batches, folder, workdir, on_progress, ratio, reserve,
                                   placed.device)
        else:
            measured = _each(placed, Measuring(models, keys, batches, folder, workdir, on_progress, reads),
                             reserve)
        reads.finish()
    except BaseException as exc:
        error = exc
        raise
    finally:
        if restore is not None:
            restore()
        reads.close(clear=False, error=error)
    texts = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    result = Measurement(tuple(measured), len(tokens), texts, merged)
    write_file_atomic(folder / MANIFEST, (json.dumps(result.to_json(), indent=1, sort_keys=True) + "\n").encode())
    reads.close()
    shutil.rmtree(workdir, ignore_errors=True)
    return result, measured


def _each(placed: Placed, measuring: Measuring, reserve: Reserve) -> list[MeasuredModel]:
    """Each model measured on a placement of its own (:meth:`~resumerge.forward.placing.sites.Seats.each`), its layers
    recorded by a watch of its own where they run: in this process on ``placed.device``, each admitted by ``reserve``,
    reading the whole embedding table as the proof of its files wants it read; on a node, what it read of a hub file
    held to the journal and read here too, for its file's proof."""
    from contextlib import contextmanager

    from resumerge.analyses.measure.grams import GramWatch, tokens_of
    from resumerge.forward.job.placement import Streams
    from resumerge.forward.placing.sites import EachModel

    m = measuring
    watches = [GramWatch(tokens_of(m.batches)) for _ in m.models]
    lock = threading.Lock()  # each model's thread tells its node's reads

    def on_reads(index: int, found: list[Read]) -> None:
        with lock:
            m.reads.elsewhere(m.models[index], found, prove=True)

    @contextmanager
    def here(index: int) -> Iterator[Placement]:
        with stream_of(m.models[index], m.keys[index], placed.device) as stream:
            yield Streams([stream], reserve=reserve, watch=watches[index], names=[str(stream.reader.directory)],
                          rows=False)

    def run(index: int, placement: Placement) -> MeasuredModel:
        return measured_on(placement, watches[index], m, index)

    return placed.seats.each(EachModel(m.models, placed.layers, watches, here, "measure", on_reads), run)


def measured_on(placement: Placement, watch: GramWatch, measuring: Measuring, index: int) -> MeasuredModel:
    """The ``index``-th of the measurement's models measured on ``placement`` (of that model alone: this process,
    or its Ray actor; its layers recorded by ``watch``), journaled in the measurement's workdir; its manifest
    entry."""
    from resumerge.analyses.measure.grams import measure_model

    layers, count, on_progress = placement.layers, len(measuring.models), measuring.on_progress

    def on_layer(layer: int) -> None:
        if on_progress is not None:
            on_progress(f"model {index + 1} of {count}, layer {layer + 1} of {layers}")

    measure_model(placement, watch, measuring.batches, measuring.folder, index,
                  measuring.workdir / HIDDEN / model_folder(index), on_layer=on_layer)
    return recorded(measuring.models[index], measuring.keys[index], measuring.folder, index, layers)


def _run_merged(models: list[PassModel], keys: list[str], batches: list[tuple[torch.Tensor, torch.Tensor]],
                folder: Path, workdir: Path, on_progress: Callable[[str], None] | None, ratio: float,
                reserve: Reserve, device: str) -> list[MeasuredModel]:
    """RegMean++'s pass: every model's layer l measured on the merged model's layers before l, every model's
    stream open at once (one layer of each read at a time)."""
    from resumerge.analyses.measure.grams import measure_merged

    streams = []
    try:
        for key, model in zip(keys, models):
            streams.append(stream_of(model, key, device))
        layers = streams[0].layers
        if any(s.layers != layers for s in streams):
            raise UsageError("RegMean++ merges models of one layer count, and these differ: "
                             + ", ".join(f"{k} {s.layers}" for k, s in zip(keys, streams)))

        def on_layer(layer: int) -> None:
            if on_progress is not None:
                on_progress(f"merged pass, layer {layer + 1} of {layers} ({len(models)} models)")

        measure_merged(streams, batches, folder, workdir / HIDDEN / "merged", layer_merge(ratio),
                       on_layer=on_layer, reserve=reserve)
    finally:
        for stream in streams:
            stream.close()
    return [recorded(model, keys[i], folder, i, layers) for i, model in enumerate(models)]


def layer_merge(ratio: float) -> LayerMerge:
    """How the merged pass merges a layer's weight: ``regmean``'s solve where it has Grams, else the mean; float32."""
    from resumerge.machine.torch_import import torch
    from resumerge.merge.methods.regmean import mean, regmean_solve

    def merge(name: str, values: list[torch.Tensor], grams: list[torch.Tensor] | None) -> torch.Tensor:
        if grams is None:
            return mean(values).to(torch.float32)
        solved, _ = regmean_solve(values, grams, ratio)
        return solved.to(torch.float32)

    return merge


def recorded(model: PassModel, key: str, folder: Path, index: int, layers: int) -> MeasuredModel:
    """The manifest's entry of the ``index``-th model: every layer file's linears and sha256."""
    grams: dict[str, GramRef] = {}
    digests: dict[str, str] = {}
    tokens = 0
    for layer in range(layers):
        name = layer_file(index, layer)
        header = read_header(folder / name)
        doc = json.loads(header.metadata[METADATA_KEY])
        tokens = int(doc["tokens"])
        for linear, owner in doc["inputs"].items():
            grams[linear] = GramRef(name, owner, int(header.tensors[owner].shape[0]))
        digests[name] = sha256_of(folder / name)
    files = tuple((f.name, f.size, f.identity) for f in model.opened.files)
    return MeasuredModel(key, os.fspath(model.opened.directory), files, tokens, grams, digests)

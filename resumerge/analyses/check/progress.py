"""Where a check stands, for ``status``: a small JSON file in the check's folder under the state dir
(``checks/<key>/progress.json``), rewritten as the check moves (the static pass, each model of each decoder layer,
the heads, the verdict), and found again by the merged model's folder.

It is advice, not a journal: the per-layer journal (:mod:`resumerge.forward.compared.passes`) is what a resumed check
trusts. A check whose process is gone before its verdict is ``interrupted``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.machine.durable import write_file_atomic
from resumerge.machine.runlock import pid_alive
from resumerge.machine.threadcount import recorded_threads, threads_rows

if TYPE_CHECKING:
    from resumerge.merge.store.statusview import StatusReport

# In a check's folder (under :attr:`resumerge.config.locations.StateDir.checks_dir`).
PROGRESS_NAME = "progress.json"


@dataclass(frozen=True)
class Step:
    """Where a check is, as its watcher is told (``resumerge.analyses.check(progress=...)``; the CLI draws it as ``run``
    draws a merge): the ``phase`` (starting, static, forward, heads, done), the decoder ``layer`` (0-based, None
    outside the forward pass) of ``layers``, the model running (``model_index`` of ``models``, its ``role`` and
    ``path``; None where every model runs at once, on Ray nodes), and the ``tokens`` each model predicts."""

    model: str
    phase: str
    layer: int | None
    layers: int
    model_index: int | None
    models: int
    role: str | None
    path: str | None
    tokens: int


# Told each step of a check (see :class:`Step`).
Watcher = Callable[[Step], None]


class Progress:
    """The progress file of the check of ``model`` in ``workdir``: each :meth:`say` rewrites it whole, and tells
    ``watcher`` (where given) the step."""

    def __init__(self, workdir: Path, model: str | os.PathLike[str], layers: int, models: int,
                 watcher: Watcher | None = None, tokens: int = 0, command: str | None = None) -> None:
        self.watcher, self.tokens, self.given = watcher, tokens, os.fspath(model)
        self.path = workdir / PROGRESS_NAME
        self.doc: dict[str, Any] = {"model": os.path.abspath(model), "pid": os.getpid(), "layers": layers,
                                    "report": os.path.abspath(workdir / "report.json"),
                                    "models": models, "phase": "starting", "layer": None, "model_index": None,
                                    "model_role": None, "model_path": None, "nodes": None, "verdict": None,
                                    "command": command}

    def say(self, **changes: Any) -> None:
        """Record ``changes`` (atomically: a reader sees the old file or the new one). Not fsynced, but for the
        last word (a verdict): progress only shows where a check is, the journal is what it resumes from, and two
        fsyncs for each model's layer were 3 % of a small model's check."""
        self.doc.update(changes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(self.doc, sort_keys=True) + "\n").encode()
        if self.doc.get("verdict") is not None:
            write_file_atomic(self.path, data)
        else:
            temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            temp.write_bytes(data)
            os.replace(temp, self.path)
        if self.watcher is not None:
            d = self.doc
            self.watcher(Step(self.given, str(d["phase"]), d.get("layer"), int(d["layers"]), d.get("model_index"),
                              int(d["models"]), d.get("model_role"), d.get("model_path"), self.tokens))


def layer_lines(say: Callable[[str], None]) -> Watcher:
    """A watcher that tells ``say`` one line as each phase and each decoder layer begins (``run --check``: the
    run's reporter says them as it says the merge's notes)."""
    said: set[tuple[str, int | None]] = set()

    def watch(step: Step) -> None:
        where = (step.phase, step.layer)
        if where in said or step.phase in ("starting", "done"):
            return
        said.add(where)
        if step.phase == "forward" and step.layer is not None:
            say(f"check: layer {step.layer + 1} of {step.layers} ({step.models} models, {step.tokens:,} tokens each)")
        elif step.phase != "forward":
            say(f"check: the {'static pass' if step.phase == 'static' else step.phase}")

    return watch


def find_progress(root: Path, model: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest check of ``model`` under ``root`` (the state dir's ``checks`` folder), its ``state`` set to
    running, interrupted or done; None when there is none."""
    wanted = os.path.abspath(model)
    found: list[tuple[float, Path, dict[str, Any]]] = []
    for path in root.glob(f"*/{PROGRESS_NAME}"):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            when = path.stat().st_mtime
        except (OSError, ValueError):  # half-written by nobody (atomic), or removed meanwhile: not this one
            continue
        if isinstance(doc, dict) and doc.get("model") == wanted:
            found.append((when, path.parent, doc))
    if not found:
        return None
    _, folder, doc = max(found, key=lambda each: each[0])
    doc["state"] = "done" if doc.get("verdict") else "running" if pid_alive(doc.get("pid")) else "interrupted"
    doc["threads"] = recorded_threads(folder)  # the count its pass computes with (None: not started yet)
    return doc


def check_status(root: Path, model: str | os.PathLike[str]) -> StatusReport | None:
    """``resumerge status MODEL`` for a model that was checked and never merged into here (any folder): its newest
    check under ``root`` as a status of its own (kind ``check``: its decoder layers of every model as the steps,
    the command that continues it where it was interrupted); None when it has none."""
    from resumerge.merge.store.statusview import Details, StatusReport

    doc = find_progress(root, model)
    if doc is None:
        return None
    layers, models = int(doc.get("layers") or 0), int(doc.get("models") or 1)
    layer = doc.get("layer")
    finished = doc["state"] == "done" or doc.get("phase") == "heads"
    passed = layers if finished else int(layer) if isinstance(layer, int) else 0  # the decoder layers run through
    steps = layers * models if finished else passed * models + int(doc.get("model_index") or 0)
    command = doc.get("command") if doc["state"] == "interrupted" else None
    # The table's rows: the decoder layers as the shards, each model's layer as a tensor; a check writes no bytes.
    return StatusReport(out_dir=os.fspath(model), state=str(doc["state"]), source="check",
                        tensors_total=layers * models, tensors_done=steps, shards_total=layers, shards_done=passed,
                        bytes_total=0, bytes_done=0, resume_command=command if isinstance(command, str) else None,
                        kind="check", details=Details(rows=(("check", describe(doc)),
                                                            *threads_rows(doc.get("threads"))), data={"check": doc}))


def describe(doc: Mapping[str, Any]) -> str:
    """One line for ``status``: what the check is doing, or what it found."""
    if doc.get("verdict"):
        layer = doc.get("broken_layer")
        named = f", layer {layer} departs" if isinstance(layer, int) else ""
        return f"{str(doc['verdict']).replace('_', ' ')} (exit {doc.get('exit_code')}){named}"
    state = str(doc.get("state", "running"))
    phase = doc.get("phase")
    nodes = doc.get("nodes")
    if phase == "forward" and isinstance(doc.get("layer"), int) and isinstance(nodes, list):
        return (f"{state}: layer {int(doc['layer']) + 1} of {doc.get('layers')}, {len(nodes)} models on Ray nodes "
                + ", ".join(f"{node} ({role})" for node, role in zip(nodes, doc.get("roles") or ["?"] * len(nodes))))
    if phase == "forward" and isinstance(doc.get("layer"), int):
        return (f"{state}: layer {int(doc['layer']) + 1} of {doc.get('layers')}, model {int(doc['model_index']) + 1}"
                f" of {doc.get('models')} ({doc.get('model_role')} {doc.get('model_path')})")
    return f"{state}: {phase}"

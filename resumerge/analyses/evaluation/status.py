"""``resumerge status TARGET`` for a model that was evaluated: its newest pass under the state dir's ``evals``
folder, in the evaluation's own words (its tasks, the pass and its requests, the decoder layers journaled of the
pass's layers; running while a process holds the pass's lock, else interrupted with the command that continues it,
or done)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

# store.runlock's, not forward's: status must not import the forward package (its reader imports the plan, numpy).
from resumerge.machine.runlock import is_locked
from resumerge.machine.threadcount import recorded_threads, threads_rows

if TYPE_CHECKING:
    from resumerge.merge.store.statusview import StatusReport

PROGRESS_NAME = "progress.json"
LAYER_PREFIX = "layer-"  # a pass's journal files, layer-<N>.safetensors: each pass's scorer writes them


def find_eval(root: Path, target: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest evaluation pass of ``target`` under ``root``, its ``state`` set to running (a process holds the
    pass's lock: a pid alone says "running" of a process killed and not yet reaped, or of another that took its
    number), interrupted or done; None when there is none."""
    wanted = {os.fspath(target), os.path.abspath(target)}
    found: list[tuple[float, Path, dict[str, Any]]] = []
    for path in root.glob(f"*/{PROGRESS_NAME}"):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            when = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("model") in wanted:
            found.append((when, path.parent, doc))
    if not found:
        return None
    _, folder, doc = max(found, key=lambda each: each[0])
    doc["state"] = "done" if doc.get("done") else "running" if is_locked(folder) else "interrupted"
    doc["journaled"] = _journaled(folder, doc)
    doc["threads"] = recorded_threads(folder)  # the count its pass computes with (None: not started yet)
    return doc


def _journaled(folder: Path, doc: dict[str, Any]) -> int:
    """The decoder layers of the pass whose hidden states are journaled: the newest journal file's (the progress
    file names the layer a pass started, before its file is durable), all of them from its head on."""
    layers, layer = int(doc.get("layers") or 0), doc.get("layer")
    if doc.get("done") or layer is None:
        return layers
    numbers = [int(p.stem.removeprefix(LAYER_PREFIX)) for p in folder.glob(f"{LAYER_PREFIX}*.safetensors")
               if p.stem.removeprefix(LAYER_PREFIX).isdigit()]
    return max([int(layer), *(n + 1 for n in numbers)])


def describe(doc: dict[str, Any]) -> str:
    """One line for ``status``: the tasks, the pass and where it is."""
    layer, journaled = doc.get("layer"), int(doc.get("journaled") or 0)
    where = ("done" if doc.get("done") else "the head" if layer is None
             else f"layer {int(layer) + 1} of {doc['layers']}" if doc.get("state") == "running"
             else f"continues at layer {journaled + 1} of {doc['layers']}")
    return (f"{doc['state']}: {', '.join(doc.get('tasks', []))}: {doc.get('pass')} pass of {doc.get('requests')} "
            f"request(s), {where} (model {doc.get('target')})")


def eval_status(root: Path, target: str | os.PathLike[str]) -> StatusReport | None:
    """The status of the newest evaluation of ``target`` (kind ``eval``: the pass's decoder layers journaled and
    its requests answered as its counts, no shards, tensors or bytes: an evaluation writes none), or None when it
    was never evaluated here."""
    from resumerge.merge.store.statusview import Details, StatusReport

    doc = find_eval(root, target)
    if doc is None:
        return None
    layers, passed = int(doc.get("layers") or 0), int(doc["journaled"])
    requests = int(doc.get("requests") or 0)
    kind = doc.get("pass")
    counts = (("layers", passed, layers, f"journaled of the {kind} pass"),
              ("requests", requests if doc.get("done") else 0, requests, f"answered by the {kind} pass"))
    rows = [("eval", describe(doc)), *threads_rows(doc.get("threads"))]
    if doc["state"] == "running":
        rows.append(("process", f"pid {doc.get('pid')} holds the pass's lock"))
    command = doc.get("command") if doc["state"] == "interrupted" else None
    return StatusReport(out_dir=os.fspath(target), state=str(doc["state"]), source="eval", tensors_total=layers,
                        tensors_done=passed, shards_total=layers, shards_done=passed, bytes_total=0, bytes_done=0,
                        resume_command=command if isinstance(command, str) else None, kind="eval",
                        details=Details(counts=counts, rows=tuple(rows), data={"eval": doc}, counts_only=True))

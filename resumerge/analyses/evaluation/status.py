"""``resumerge status TARGET`` for a model that was evaluated: its newest pass under the state dir's ``evals``
folder (running: its tasks, pass and layer; interrupted: the command that continues it; done)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.store.runlock import pid_alive

if TYPE_CHECKING:
    from resumerge.store.statusview import StatusReport

PROGRESS_NAME = "progress.json"


def find_eval(root: Path, target: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest evaluation pass of ``target`` under ``root``, its ``state`` set to running, interrupted or done;
    None when there is none."""
    wanted = {os.fspath(target), os.path.abspath(target)}
    found: list[tuple[float, dict[str, Any]]] = []
    for path in root.glob(f"*/{PROGRESS_NAME}"):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            when = path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("model") in wanted:
            found.append((when, doc))
    if not found:
        return None
    doc = max(found, key=lambda pair: pair[0])[1]
    doc["state"] = "done" if doc.get("done") else "running" if pid_alive(doc.get("pid")) else "interrupted"
    return doc


def describe(doc: dict[str, Any]) -> str:
    """One line for ``status``: the tasks, the pass and where it is."""
    layer = doc.get("layer")
    where = "done" if doc.get("done") else "the head" if layer is None else f"layer {int(layer) + 1} of {doc['layers']}"
    return (f"{doc['state']}: {', '.join(doc.get('tasks', []))}: {doc.get('pass')} pass of {doc.get('requests')} "
            f"request(s), {where} (model {doc.get('target')})")


def eval_status(root: Path, target: str | os.PathLike[str]) -> StatusReport | None:
    """The status of the newest evaluation of ``target`` (kind ``eval``: its decoder layers as the steps), or None
    when it was never evaluated here."""
    from resumerge.store.statusview import Details, StatusReport

    doc = find_eval(root, target)
    if doc is None:
        return None
    layers, layer = int(doc.get("layers") or 0), doc.get("layer")
    passed = layers if doc.get("done") or layer is None else int(layer)
    command = doc.get("command") if doc["state"] == "interrupted" else None
    return StatusReport(out_dir=os.fspath(target), state=str(doc["state"]), source="eval", tensors_total=layers,
                        tensors_done=passed, shards_total=layers, shards_done=passed, bytes_total=0, bytes_done=0,
                        resume_command=command if isinstance(command, str) else None, kind="eval",
                        details=Details(rows=(("eval", describe(doc)),), data={"eval": doc}))

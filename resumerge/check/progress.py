"""Where a check stands, for ``status``: a small JSON file in the check's folder under the state dir
(``checks/<key>/progress.json``), rewritten as the check moves (the static pass, each model of each decoder layer,
the heads, the verdict), and found again by the merged model's folder.

It is advice, not a journal: the per-layer journal (:mod:`.passes`) is what a resumed check trusts. A check whose
process is gone before its verdict is ``interrupted``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resumerge.store.durable import write_file_atomic

# In a check's folder (under :attr:`resumerge.config.locations.StateDir.checks_dir`).
PROGRESS_NAME = "progress.json"


class Progress:
    """The progress file of the check of ``model`` in ``workdir``: each :meth:`say` rewrites it whole."""

    def __init__(self, workdir: Path, model: str | os.PathLike[str], layers: int, models: int) -> None:
        self.path = workdir / PROGRESS_NAME
        self.doc: dict[str, Any] = {"model": os.path.abspath(model), "pid": os.getpid(), "layers": layers,
                                    "report": os.path.abspath(workdir / "report.json"),
                                    "models": models, "phase": "starting", "layer": None, "model_index": None,
                                    "model_role": None, "model_path": None, "nodes": None, "verdict": None}

    def say(self, **changes: Any) -> None:
        """Record ``changes`` (atomically: a reader sees the old file or the new one). Not fsynced, but for the
        last word (a verdict): progress only shows where a check is, the journal is what it resumes from, and two
        fsyncs for each model's layer were 3 % of a small model's check."""
        self.doc.update(changes)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (json.dumps(self.doc, sort_keys=True) + "\n").encode()
        if self.doc.get("verdict") is not None:
            write_file_atomic(self.path, data)
            return
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temp.write_bytes(data)
        os.replace(temp, self.path)


def find_progress(root: Path, model: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest check of ``model`` under ``root`` (the state dir's ``checks`` folder), its ``state`` set to
    running, interrupted or done; None when there is none."""
    wanted = os.path.abspath(model)
    found: list[tuple[float, dict[str, Any]]] = []
    for path in root.glob(f"*/{PROGRESS_NAME}"):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            when = path.stat().st_mtime
        except (OSError, ValueError):  # half-written by nobody (atomic), or removed meanwhile: not this one
            continue
        if isinstance(doc, dict) and doc.get("model") == wanted:
            found.append((when, doc))
    if not found:
        return None
    doc = max(found, key=lambda pair: pair[0])[1]
    doc["state"] = "done" if doc.get("verdict") else "running" if _alive(doc.get("pid")) else "interrupted"
    return doc


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


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

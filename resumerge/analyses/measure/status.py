"""Where a ``resumerge measure`` folder stands, for ``resumerge status``: read from the folder's listing and its run
file alone, so ``status`` imports nothing heavy (no torch, no input readers: the names of the folder's files are
repeated here from :mod:`resumerge.inputs.grams`, and a test holds the two equal)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resumerge.merge.store.statusview import StatusReport

# What the measurement records first: its key, config, models and their layer counts.
RUN_FILE = "measure-run.json"
MANIFEST = "measure.json"
LAYER_PREFIX = "layer-"
LOCK_FILE = ".lock"  # held by the process measuring into the folder (resumerge.analyses.measure.run takes it)


def measure_status(out: str | os.PathLike[str]) -> StatusReport | None:
    """Where the measurement in ``out`` stands, as ``resumerge status`` shows a run (None: ``out`` holds none):
    its Gram files as the shards, each model's decoder layers as its tensors, the model under way, and the command
    that resumes it (none while a process holds the folder's lock: running). Reads the folder's listing only."""
    from resumerge.machine.runlock import is_held
    from resumerge.merge.store.statusview import Details, StatusReport

    folder = Path(out)
    try:
        run = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
        keys, layers = list(run["models"]), [int(n) for n in run["layers"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    done = [sum(1 for p in (folder / f"model-{i:02d}").glob(f"{LAYER_PREFIX}*.safetensors")) for i in range(len(keys))]
    finished = (folder / MANIFEST).is_file()
    total = sum(layers)
    written = sum(min(d, n) for d, n in zip(done, layers))
    size = sum(p.stat().st_size for p in folder.glob(f"*/{LAYER_PREFIX}*.safetensors"))
    current = next((i for i, (d, n) in enumerate(zip(done, layers)) if d < n), None)
    rows = []
    if current is not None:
        rows.append(("measure", f"model {current + 1} of {len(keys)} ({keys[current]}): {done[current]} of "
                                f"{layers[current]} decoder layers measured"))
    texts = f" --texts {run['texts']}" if run.get("texts") else ""
    running = not finished and is_held(folder / LOCK_FILE)  # a process measuring into it holds its lock
    command = None if finished or running else f"resumerge measure {run.get('config', 'CONFIG')} {folder}{texts}"
    models_done = sum(1 for d, n in zip(done, layers) if d >= n)
    details = Details(counts=(("models", models_done, len(keys), "measured"),), rows=tuple(rows),
                      data={"measure_layers": [written, total]})
    return StatusReport(out_dir=str(folder), state="done" if finished else "running" if running else "interrupted",
                        source="measurement",
                        tensors_total=total, tensors_done=written, shards_total=total, shards_done=written,
                        bytes_total=size if finished or not written else size * total // written, bytes_done=size,
                        resume_command=command, kind="measure", details=details)

"""Where a run keeps its state: one folder per output directory under the state dir (never inside OUT).

The state dir is ``--state-dir``, else ``$RESUMERGE_STATE_DIR``, else ``./state`` (the checkout's top-level
``state/`` when run from a checkout). Keep it on a local disk: SQLite fails on FUSE mounts such as Drive.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from resumerge.config.hubtarget import is_hub_target, parse_hub_target

ENV_STATE_DIR = "RESUMERGE_STATE_DIR"


def state_root(state_dir: str | os.PathLike[str] | None = None) -> Path:
    """The state directory in force for this process."""
    if state_dir is not None:
        return Path(state_dir)
    env = os.environ.get(ENV_STATE_DIR)
    return Path(env) if env else Path.cwd() / "state"


def run_dir(out_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding the ledger and lock of ``out_dir``: ``<name>-<12 hex of its real path>`` (for an
    ``hf://`` repo: ``hf-<namespace>--<name>-<12 hex of the target>``, the same on every machine)."""
    if is_hub_target(out_dir):
        return state_root(state_dir) / parse_hub_target(str(out_dir)).state_key()
    real = os.path.realpath(out_dir)
    digest = hashlib.sha256(real.encode()).hexdigest()[:12]
    return state_root(state_dir) / f"{Path(real).name or 'root'}-{digest}"

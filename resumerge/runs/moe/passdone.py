"""Whether the run about to continue OUT's recorded MoE run will find its prompt forward pass finished in the state
dir, told from the ledger before the run imports torch: then no prompt-pass process is started early for it (its
imports of torch and transformers, 3-5 CPU s, would only compete with the run's planning until the planner found
the routers and stopped it).

May import: config, errors, moe (passproc, state), store (ledger_read): standard library otherwise, no torch.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from resumerge.config.locations import RunLocations
from resumerge.errors import LedgerError
from resumerge.runs.moe.config import MoeConfig, prompt_texts
from resumerge.runs.moe.passproc import HIDDEN_MODES, routers_key
from resumerge.runs.moe.state import ROUTERS_NAME


def routers_finished(config: MoeConfig, where: RunLocations) -> bool:
    """True where the ledger in the state dir records a run of ``where.out`` that read ``config``'s base model from
    a folder of weight files, and the routers of ``config``'s forward pass over those files (the content key the
    planner computes, :func:`~resumerge.runs.moe.prepare.routers_dir`, with the installed torch's version read from its
    metadata) are finished in the state dir. False wherever that cannot be told this cheaply: nothing recorded,
    another base or a GGUF one (its folder is rebuilt under the state dir), a torch whose metadata names another
    version than it does: the pass's process is then started early, as for a first run, and the planner decides as
    before."""
    if config.gate_mode not in HIDDEN_MODES or not where.ledger.is_file():
        return False
    from resumerge.merge.store.ledger_read import reading, run_row

    try:
        with reading(where.ledger, "ledger") as conn:
            row = run_row(conn)
    except LedgerError:
        return False
    base = config.base_model.key
    if row is None or row.kind != "moe" or base not in row.inputs or base not in row.model_dirs:
        return False
    files = row.inputs[base]
    if not isinstance(files, list) or any(not isinstance(f, list) or str(f[0]).endswith(".gguf") for f in files):
        return False
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    key = routers_key([tuple(f) for f in files], config.gate_mode, prompt_texts(config), Path(row.model_dirs[base]),
                      torch_version=torch_version)
    return (where.state.routers_dir / key / ROUTERS_NAME).is_file()

"""``eval`` as a row of the analyses table (:mod:`resumerge.config.analyses`): a model that was only evaluated is its
own folder for ``status`` (its newest evaluation's tasks, pass and layer); its journal is the state dir's
``evals``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.evaluation.status import eval_status, find_eval

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.merge.store.statusview import StatusReport


class EvalAnalysis:
    """``resumerge eval``'s journal of a model."""

    def holds(self, out: str | os.PathLike[str], state: StateDir) -> bool:
        return find_eval(state.evals_dir, out) is not None

    def status(self, out: str | os.PathLike[str], state: StateDir) -> StatusReport:
        from resumerge.merge.store.statusview import recorded

        return recorded(eval_status(state.evals_dir, out), f"{out} was never evaluated here")

    def journal(self, state: StateDir) -> Path:
        return state.evals_dir

"""``measure`` as a row of the analyses table (:mod:`resumerge.config.analyses`): its OUT_DIR recognised by its run
file, its status read from the folder's listing (:mod:`.status`, nothing heavy imported), its journal under the
state dir's ``measures``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.measure.status import RUN_FILE, measure_status

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.merge.store.statusview import StatusReport


class MeasureAnalysis:
    """``resumerge measure``'s Grams folder."""

    def holds(self, out: str | os.PathLike[str], state: StateDir) -> bool:
        return not os.fspath(out).startswith("hf://") and (Path(out) / RUN_FILE).is_file()

    def status(self, out: str | os.PathLike[str], state: StateDir) -> StatusReport:
        found = measure_status(out)
        if found is None:
            from resumerge.errors import NothingRecordedError

            raise NothingRecordedError(f"{out} holds no measurement resumerge can read")
        return found

    def journal(self, state: StateDir) -> Path:
        return state.measures_dir

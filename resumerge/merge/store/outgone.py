"""What a missing local OUT means when the run's ledger records files committed there: the output was moved or
deleted. ``status``, ``verify`` and ``resume`` all say it through :func:`refuse_gone` (exit 4, with the command
that resumes it where it is now), rather than each telling its own story (``verify`` once listed every file as
"missing" and offered ``resume``, which then refused).
"""

from __future__ import annotations

import os
from pathlib import Path

from resumerge.config.locations import StateDir
from resumerge.errors import OutputDirError


def moved_error(out: str | os.PathLike[str], committed: int, where: str) -> OutputDirError:
    """A local OUT gone though the ledger records ``committed`` files committed there: the output was moved or
    deleted (re-creating it would redo the whole merge in the wrong place). ``where`` resumes it at its new place."""
    return OutputDirError(
        f"{out} does not exist, though {committed} file(s) were committed there: the output may have moved",
        path=str(out),
        hint=f"resume it where it is now with {where}, or start over with resumerge run CONFIG {out} --restart",
    )


def refuse_gone(out: str | os.PathLike[str], committed: int, state: StateDir) -> None:
    """Raise :func:`moved_error` when the local folder ``out`` does not exist though the ledger records
    ``committed`` files committed there (none committed: nothing was lost, the run simply has not written yet)."""
    if committed and not Path(out).exists():
        raise moved_error(out, committed, state.resume_command("NEW_PATH"))

"""Deleting a recipe stage's output (its intermediates once the final output is verified, a stage run again from
scratch): only the files resumerge wrote there, the manifest last, then the stage's ledger."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

from resumerge.config.locations import LEDGER_NAME, RunLocations
from resumerge.errors import OutputDirError
from resumerge.machine.durable import fsync_dir, is_temp_name
from resumerge.machine.runlock import LOCK_NAME, is_locked
from resumerge.merge.store.journal import journal_files
from resumerge.merge.store.manifest import MANIFEST_NAME, read_manifest

# A stage's files in the state dir: its SQLite ledger with WAL/journal companions, and its lock.
_LEDGER_FILES = (*journal_files(LEDGER_NAME), LOCK_NAME)


def discard_stage_output(out_dir: Path, names: Iterable[str], where: RunLocations) -> int:
    """Delete a stage's output: the files its plan names (and its manifest's), their temp files, the manifest,
    then its ledger in the state dir; the folder too when that leaves it empty. Never any other file.

    ``where`` is the locations of the stage's output. Returns the number of files deleted. Raises
    :class:`OutputDirError` when a process is merging into it.
    """
    rdir = where.run_dir
    if is_locked(rdir):
        raise OutputDirError(f"another resumerge process is merging into {out_dir}", path=str(out_dir))
    removed = 0
    if out_dir.is_dir():
        manifest = read_manifest(out_dir)
        planned = set(names) | set(manifest.planned if manifest else ())
        for entry in sorted(out_dir.iterdir()):
            ours = entry.name in planned or is_temp_name(entry.name, planned | {MANIFEST_NAME})
            if ours and entry.is_file() and not entry.is_symlink():
                entry.unlink()
                removed += 1
        # The manifest goes last: until then the folder still says it is resumerge's.
        if (out_dir / MANIFEST_NAME).is_file():
            (out_dir / MANIFEST_NAME).unlink()
            removed += 1
        fsync_dir(out_dir)
        rmdir_if_empty(out_dir)
    for name in _LEDGER_FILES:
        (rdir / name).unlink(missing_ok=True)
    rmdir_if_empty(rdir)
    return removed


def rmdir_if_empty(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (other files are never ours to delete) or already gone
        directory.rmdir()

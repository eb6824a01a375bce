"""A pass folder's lock: one process at a time journals in it (two at once would delete each other's layer
files), the second refused naming the first (:class:`~resumerge.machine.runlock.JobLock`, exit 4)."""

from __future__ import annotations

from pathlib import Path

# The lock file is a run's (store.runlock's name): held by the one process running the pass, its pid and command in it.
from resumerge.machine.runlock import LOCK_NAME, JobLock


def pass_lock(folder: Path, what: str, command: str, *, hint: str, name: str = LOCK_NAME,
              wait: bool = False) -> JobLock:
    """The lock of the pass journaled in ``folder`` (``what``: the job in words; ``command``: what the holder
    runs, named to a second process; ``name``: the lock file's, in ``folder``; ``wait``: a second process waits
    for the first instead of being refused)."""
    return JobLock(folder / name, what, command, hint=hint, wait=wait)

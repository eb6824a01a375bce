"""The planning mark: a file in the run's state folder that a ``run`` or ``resume`` holds (an exclusive flock)
while it plans and until its plan is recorded, so that ``status`` says "planning" from the first second instead of
"no merge recorded" (planning a 90k-tensor merge takes seconds to tens of seconds).

The lock vanishes with the process, so a killed run leaves no mark that ``status`` believes. The mark is advisory:
a state dir that cannot be written, or a second process marking the same run, only means ``status`` cannot say
"planning" (the run's own lock still refuses a second run). Standard library only (``status`` imports it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

PLANNING_NAME = "planning"


@contextlib.contextmanager
def planning_mark(run_dir: Path) -> Iterator[None]:
    """Hold the planning mark of the run whose state folder is ``run_dir`` for the block (created if needed; the
    folders this creates, the state dir's included, are removed again when the block leaves them empty)."""
    created = []  # the folders this makes, deepest first: removed again if left empty
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        created.append(folder)
        folder = folder.parent
    fd = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / PLANNING_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, repr(time.time()).encode(), 0)
    except OSError:  # unwritable state dir, or another process's mark: status just cannot say "planning"
        if fd is not None:
            os.close(fd)
        fd = None
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                (run_dir / PLANNING_NAME).unlink()
            os.close(fd)
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # the run wrote there (its ledger), or another process did
                break


def planning_since(run_dir: Path) -> float | None:
    """When the live process planning the run of ``run_dir`` started (a time.time() value), or None when none is
    (no mark, or one whose process is gone)."""
    try:
        fd = os.open(run_dir / PLANNING_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 64, 0).decode(errors="replace")
        try:
            return float(text)
        except ValueError:  # held but not yet written: it started just now
            return time.time()
    except OSError:
        return None
    finally:
        os.close(fd)
    return None

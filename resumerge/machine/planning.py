"""The planning mark: a file in the run's state folder that a ``run`` or ``resume`` holds (an exclusive flock)
while it plans and until its plan is recorded, so that ``status`` says "planning" from the first second instead of
"no merge recorded" (planning a 90k-tensor merge takes seconds to tens of seconds).

A run killed while it plans (a mergekit-moe config's prompt forward pass can run for long before the plan is
recorded) leaves its mark behind, held by no process: ``status`` and ``resume`` then say that nothing was recorded
because the run died planning, and that running it again continues (:func:`killed_planning`).

The lock vanishes with the process, so a killed run leaves no mark that ``status`` takes for a live one. The mark
is advisory: a state dir that cannot be written, or a second process marking the same run, only means ``status``
cannot say "planning" (the run's own lock still refuses a second run). The mark names the kind of run that holds
it, so that what a killed one had done is told by its own kind (at the API, which knows the kinds), never guessed
here. Standard library only (``status`` imports it), with the errors.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from resumerge.errors import KilledPlanningError

PLANNING_NAME = "planning"
# A mark found held by no process when a run or resume takes its own: kept under this name (its start time), so
# that the next ``status`` or ``resume`` can still say the run died planning.
KILLED_NAME = "planning.killed"


@contextlib.contextmanager
def planning_mark(run_dir: Path, kind: str = "") -> Iterator[None]:
    """Hold the planning mark of the run whose state folder is ``run_dir`` for the block (created if needed; the
    folders this creates, the state dir's included, are removed again when the block leaves them empty); ``kind``:
    the name of the kind of run planning (empty: a single merge, or a resume that does not know it yet)."""
    created = []  # the folders this makes, deepest first: removed again if left empty
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        created.append(folder)
        folder = folder.parent
    fd = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        left = _mark(run_dir)
        if left is not None and not left[1] and left[2]:  # written, then its process died: keep what it says
            os.replace(run_dir / PLANNING_NAME, run_dir / KILLED_NAME)
        fd = os.open(run_dir / PLANNING_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{time.time()!r} {kind}".strip().encode(), 0)
    except OSError:  # unwritable state dir, or another process's mark: status just cannot say "planning"
        if fd is not None:
            os.close(fd)
        fd = None
    try:
        yield
        if fd is not None:  # planned (or ended) this time: the story of a killed one is over
            with contextlib.suppress(OSError):
                (run_dir / KILLED_NAME).unlink()
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
    found = _mark(run_dir)
    return found[0] if found is not None and found[1] else None


def killed_planning(run_dir: Path) -> float | None:
    """When a run or resume of ``run_dir`` started planning, if its process died before it recorded its plan and
    before it could take its mark away (a SIGKILL, the OOM killer, a runtime reset): its mark is left, held by no
    process. None when there is no such mark (none, or a live one)."""
    found = _killed_mark(run_dir)
    return found[0] if found is not None else None


def _killed_mark(run_dir: Path) -> tuple[float, bool, bool, str] | None:
    found = _mark(run_dir)
    if found is not None and not found[1]:
        return found
    return _mark(run_dir, KILLED_NAME)  # set aside by a run or resume since (one that died planning too)


def _mark(run_dir: Path, name: str = PLANNING_NAME) -> tuple[float, bool, bool, str] | None:
    """The mark's start time, whether a process holds it, whether its time was written, and the kind that wrote it;
    None without one."""
    try:
        fd = os.open(run_dir / name, os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        else:
            held = False
        when, _, kind = text.partition(" ")
        try:
            return float(when), held, True, kind.strip()
        except ValueError:  # held but not yet written (it started just now), or died before it wrote
            return (time.time() if held else os.fstat(fd).st_mtime), held, False, ""
    except OSError:
        return None
    finally:
        os.close(fd)


def killed_while_planning(out: str, run_dir: Path) -> KilledPlanningError | None:
    """What ``status``, ``resume`` and ``verify`` say of an OUT with no record when the run into it was killed
    while it planned (:func:`killed_planning`): nothing was written, and running it again continues; the error
    names the kind the mark named, whose own account of what the run had done (a mergekit-moe config's prompt
    forward pass, continued from the decoder layer it reached) the API adds. None when that is not so."""
    found = _killed_mark(run_dir)
    if found is None:
        return None
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime(found[0]))
    what = f"{found[3]} run" if found[3] else "merge"  # the kind its mark names
    return KilledPlanningError(
        f"no {what} recorded for {out}: the run started {started} was killed while planning, before it recorded "
        "its plan, and wrote nothing",
        path=str(out), hint=f"run the same resumerge run CONFIG {out} again", kind=found[3])

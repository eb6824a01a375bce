"""What a stopped run does with files that are uploaded but wait for their batch commit (a hub repo OUT).

Ctrl-C (or SIGTERM) stops the pipeline at a safe point. The sink then gets one last commit of what it has already
uploaded and not committed (only a sink that commits in batches has any), so the resume does not compute those files
again; the wait for it is bounded (:data:`FINAL_COMMIT_WAIT`), and a second Ctrl-C abandons it at once. Abandoning
loses nothing: the ledger records only what a commit holds, and the resume adopts a commit that landed after all, as
after a kill.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the journaling process's (a cluster node's worker imports this module, and journals nothing)
    from resumerge.merge.store.journal_commit import CommitJournal

# Long enough for a commit of many files on a slow link (it only names objects already uploaded), short enough for
# the grace period before SIGKILL of the places people merge in (30 s on a preemptible VM, Docker's 10 s aside).
FINAL_COMMIT_WAIT = 25.0


def commit_uploaded(journal: CommitJournal, message: Callable[[str], None], *,
                    wait: float = FINAL_COMMIT_WAIT) -> None:
    """Have the sink commit what it already uploaded and ``journal`` record what got committed, telling the user
    through ``message``; returns at once for a sink that commits every file as it is published."""
    count = journal.stop()
    if count:
        message(f"committing {count} uploaded file{'s' if count != 1 else ''}… (at most {wait:g} s; Ctrl-C again "
                "to skip: the resume makes them again)")
    try:
        with _second_interrupt_raises():
            problem = journal.stopped(wait)
    except KeyboardInterrupt:
        journal.stopped(0)
        problem = "abandoned by a second interrupt"
    if count and problem is not None:
        message(f"the last commit did not happen ({problem}); the resume makes those files again")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _second_interrupt_raises() -> Iterator[None]:
    """While the last commit runs, SIGINT and SIGTERM raise KeyboardInterrupt in this (main) thread: the CLI's own
    handler only sets the stop flag, which is set already, so a second Ctrl-C would otherwise change nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    # SIGTERM only where a Python handler stands (the CLI's stop flag): left at its default it still ends the
    # process. None means a handler installed outside Python, which could not be restored: left alone.
    previous = {s: h for s, h in previous.items() if h is not None and (s == signal.SIGINT or callable(h))}
    for s in previous:
        signal.signal(s, _raise_interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

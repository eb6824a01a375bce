"""What the merging commands share at the terminal: the stop flag that SIGINT/SIGTERM set, the progress
display's lifetime, quiet hub uploads and ``plan``'s exit code.

Used by :mod:`resumerge.cli.commands`. Options are not turned into settings here: :mod:`resumerge.api` owns them.
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING

from resumerge.errors import EXIT_INVALID, EXIT_OK

if TYPE_CHECKING:
    from resumerge.cli.render import ProgressReporter


class StopFlag:
    """Set by SIGINT/SIGTERM; the engine stops at its next safe point."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        """Route SIGINT and SIGTERM to this flag (the first one prints what happens next)."""
        def handler(signum: int, frame: FrameType | None) -> None:
            if not self.event.is_set():
                print(f"\n{signal.Signals(signum).name}: stopping at the next safe point...", file=sys.stderr)
            self.event.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def __call__(self) -> bool:
        return self.event.is_set()


def installed_stop_flag() -> StopFlag:
    """A :class:`StopFlag` already receiving SIGINT and SIGTERM (and ignoring them once the interpreter exits)."""
    stop = StopFlag()
    stop.install()
    _ignore_signals_at_exit()
    return stop


_EXIT_HOOK: list[bool] = []


def _ignore_signals_at_exit() -> None:
    """Once the command is over, the interpreter's exit still takes most of a second (torch's teardown), during
    which Python puts its SIGINT and SIGTERM handlers back to the defaults: a signal then ended a finished merge,
    after its "done:" line, with 130/143 and no message. The exit ignores them instead (registered once)."""
    if _EXIT_HOOK:
        return
    _EXIT_HOOK.append(True)

    def ignore() -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    atexit.register(ignore)


def quiet_hub_uploads(out: str) -> None:
    """huggingface_hub draws a tqdm bar per uploaded file; with hf:// OUT the merge's own progress says it all."""
    from resumerge.config.hubtarget import is_hub_target

    if is_hub_target(out):
        from huggingface_hub.utils.tqdm import disable_progress_bars

        disable_progress_bars()


class Progress:
    """Context manager around the rich progress reporter: the live display always stops, even on errors."""

    def __init__(self, quiet: bool) -> None:
        from resumerge.cli.render import ProgressReporter

        self.reporter = ProgressReporter(quiet=quiet)

    def __enter__(self) -> ProgressReporter:
        return self.reporter

    def __exit__(self, *exc: object) -> None:
        self.reporter.close()


def fits_exit_code(fits: bool, reasons: Iterable[str]) -> int:
    """``plan``'s exit code: 0 when the merge fits, else exit 2 after one ``will not fit:`` line per reason."""
    if fits:
        return EXIT_OK
    for reason in reasons:
        print(f"will not fit: {reason}", file=sys.stderr)
    return EXIT_INVALID

"""What every merging command shares: turning parsed options into the engine's knobs (sizes, staging, how an
``hf://`` OUT is committed), the stop flag that SIGINT/SIGTERM set, and the progress display's lifetime.

Used by :mod:`resumerge.cli.commands` and :mod:`resumerge.cli.recipes`; argv itself is parsed only in
``commands``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING

from resumerge.errors import EXIT_INVALID, EXIT_OK, UsageError

if TYPE_CHECKING:
    from resumerge.cli.render import ProgressReporter
    from resumerge.engine.settings import RunSettings
    from resumerge.store.hubsink import HubOutputOptions


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
    """A :class:`StopFlag` already receiving SIGINT and SIGTERM."""
    stop = StopFlag()
    stop.install()
    return stop


def size_option(args: argparse.Namespace, option: str = "--max-memory") -> int | None:
    """The size given with ``option`` in bytes, or None when it was not given; raises :class:`UsageError` (exit 2)
    for a size that is not positive."""
    text = getattr(args, option.lstrip("-").replace("-", "_"), None)
    if text is None:
        return None
    from resumerge.memory.sizes import parse_size

    value = parse_size(text, option=option)
    if value <= 0:
        raise UsageError(f"{option} must be positive")
    return value


def hub_output(args: argparse.Namespace) -> HubOutputOptions:
    """How an hf:// OUT is created and committed to (ignored for a directory)."""
    from resumerge.store.hubcommits import Batching
    from resumerge.store.hubsink import HubOutputOptions

    if args.commit_every < 1 or args.commit_interval < 0:
        raise UsageError("--commit-every must be at least 1 and --commit-interval at least 0")
    return HubOutputOptions(public=getattr(args, "public", False),
                            batching=Batching(every=args.commit_every, interval=args.commit_interval))


def run_settings(args: argparse.Namespace, *, output: bool = True) -> RunSettings:
    """The run's settings from the parsed options (``output`` false: the command has no hub commit options)."""
    from resumerge.engine.settings import RunSettings
    from resumerge.store.hubsink import HubOutputOptions

    return RunSettings(state_dir=args.state_dir, cache_dir=getattr(args, "transformers_cache", None),
                       max_memory=size_option(args), max_gpu_memory=size_option(args, "--max-gpu-memory"),
                       staging=staging_choice(args), max_disk=size_option(args, "--max-disk"),
                       output=hub_output(args) if output else HubOutputOptions())


def staging_choice(args: argparse.Namespace) -> str | bool | None:
    """--staging-dir DIR, --no-staging, or None (stage only when OUT is remote)."""
    return False if args.no_staging else args.staging_dir


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

"""Everything resumerge draws on a terminal: progress, status tables, verify results. The only module using rich.

On a TTY progress is a live bar (tensors, bytes, throughput, ETA); otherwise, or with ``--quiet`` off but no
TTY, one plain line per committed file so log files stay readable.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from resumerge.integrity import VerifyReport
from resumerge.memory.sizes import format_size
from resumerge.statusview import StatusReport

_STATE_STYLE = {"done": "green", "running": "cyan", "interrupted": "yellow", "failed": "red", "planned": "white"}


def console(stream: TextIO | None = None) -> Console:
    """A rich console on ``stream`` (stderr by default, so stdout stays machine-readable)."""
    return Console(file=stream or sys.stderr, highlight=False, soft_wrap=True)


class ProgressReporter:
    """Implements the engine's Reporter: a live bar on a TTY, plain lines elsewhere, nothing when quiet."""

    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self._console = console(stream)
        self._quiet = quiet
        self._live = not quiet and self._console.is_terminal
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._bytes = 0
        self._total = 0
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        """Show the bar (or a plain line) once the plan and what is already committed are known."""
        self._bytes, self._total = done_bytes, total_bytes
        self._started = time.monotonic()
        if self._quiet:
            return
        if not self._live:
            self._console.print(f"merging {total_tensors - done_tensors} of {total_tensors} tensors "
                                f"({format_size(total_bytes - done_bytes)} to write)")
            return
        self._progress = Progress(
            TextColumn("[bold]merging"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tensors"),
            TextColumn("{task.fields[written]}"),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self._console,
            transient=False,
        )
        self._task = self._progress.add_task("merge", total=total_tensors, completed=done_tensors,
                                             written=format_size(done_bytes))
        self._progress.start()

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Advance the bar by one tensor of ``nbytes``."""
        with self._lock:
            self._bytes += nbytes
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, advance=1, written=f"{format_size(self._bytes)}/"
                                                                     f"{format_size(self._total)}")

    def file_done(self, name: str, kind: str) -> None:
        """Note a committed file (a plain line when not live)."""
        with self._lock:
            if self._quiet or self._live:
                return
            rate = self._bytes / max(1e-6, time.monotonic() - self._started)
            self._console.print(
                f"committed {name} ({kind}; {format_size(self._bytes)} of {format_size(self._total)}, "
                f"{format_size(int(rate))}/s)"
            )

    def message(self, text: str) -> None:
        """Show a note from the engine."""
        if not self._quiet:
            self._console.print(text)

    def close(self) -> None:
        """Stop the live display."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def show_status(report: StatusReport, stream: TextIO | None = None) -> None:
    """Print a status table for a person."""
    out = console(stream or sys.stdout)
    style = _STATE_STYLE.get(report.state, "white")
    out.print(f"[bold]{report.out_dir}[/bold]: [{style}]{report.state}[/{style}] (from the {report.source})")
    table = Table(show_header=True, header_style="bold")
    for col in ("", "done", "total", ""):
        table.add_column(col)
    pct = 100.0 * report.bytes_done / report.bytes_total if report.bytes_total else 100.0
    table.add_row("shards", str(report.shards_done), str(report.shards_total), f"{pct:.0f} % of bytes")
    table.add_row("tensors", str(report.tensors_done), str(report.tensors_total), "")
    table.add_row("bytes", format_size(report.bytes_done), format_size(report.bytes_total), "")
    out.print(table)
    pending = [f.name for f in report.files if f.status != "done"]
    if pending:
        shown = ", ".join(pending[:6]) + (f" and {len(pending) - 6} more" if len(pending) > 6 else "")
        out.print(f"pending: {shown}")
    if report.peak_rss:
        out.print(f"peak memory: {format_size(report.peak_rss)}; memory adaptations: {report.adaptations}")
    if report.elapsed_seconds is not None:
        out.print(f"elapsed: {report.elapsed_seconds:.1f} s")
    if report.last_error:
        out.print(f"[red]last error:[/red] {report.last_error}")
    if report.state in ("interrupted", "failed"):
        out.print(f"finish it with: resumerge resume {report.out_dir}")


def show_verify(report: VerifyReport, stream: TextIO | None = None) -> None:
    """Print a verify report for a person."""
    out = console(stream or sys.stdout)
    if report.ok:
        out.print(f"[green]ok[/green]: {report.checked} committed files ({format_size(report.bytes_checked)}) "
                  f"match their checksums" + (f"; {report.pending} still pending" if report.pending else ""))
        return
    for d in report.damaged:
        out.print(f"[red]damaged[/red]: {d.name}: {d.problem}")
    out.print(f"repair with: resumerge resume {report.out_dir}")


def show_error(line: str, stream: TextIO | None = None) -> None:
    """Print a one-line error."""
    console(stream).print(f"[red]error:[/red] {line}", markup=True, highlight=False)

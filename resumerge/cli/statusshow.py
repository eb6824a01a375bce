"""``resumerge status``'s table (a merge's, a recipe's) and what every table of the terminal shares: the console,
a ``label  text`` line, markup escaped. Apart from :mod:`.render`'s progress bars so that ``resumerge status``
imports rich's console and table, not its progress display (issue 72: status under 0.2 s).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, TextIO

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from resumerge.machine.memory.sizes import format_duration, format_size

if TYPE_CHECKING:  # status must stay fast: these are imported only for annotations
    from resumerge.merge.store.statusview import StatusReport
    from resumerge.runs.evolve.status import SearchStatus
    from resumerge.runs.recipes.view import RecipeStatus

_STATE_STYLE = MappingProxyType({
    "done": "green", "running": "cyan", "interrupted": "yellow", "failed": "red", "planned": "white",
    "planning": "cyan",
})


class _Console(Console):
    """rich's console, but a reader gone away is the CLI's to answer: rich's own answer is ``SystemExit(1)``, the
    internal-error code with no line (``resumerge status OUT | head -1``); the CLI's entry ends such a command
    quietly, as Unix tools do (:data:`~resumerge.cli.commands.EXIT_BROKEN_PIPE`)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def console(stream: TextIO | None = None, *, width: int | None = None) -> Console:
    """A rich console on ``stream`` (stderr by default, so stdout stays machine-readable)."""
    return _Console(file=stream or sys.stderr, highlight=False, soft_wrap=True, width=width)


def show_any_status(report: StatusReport | RecipeStatus | SearchStatus, stream: TextIO | None = None) -> None:
    """``resumerge status``: a recipe's stages (:func:`show_recipe_status`), one merge's (:func:`show_status`) or a
    search's lines (on stdout, as ``resumerge evolve`` prints its outcome)."""
    from resumerge.merge.store.statusview import StatusReport  # imported by every status: the recipes' view need not be

    if isinstance(report, StatusReport):
        show_status(report, stream)
        return
    from resumerge.runs.evolve.status import SearchStatus

    if isinstance(report, SearchStatus):
        print("\n".join(report.lines()), file=stream or sys.stdout)
    else:
        show_recipe_status(report, stream)


def show_status(report: StatusReport, stream: TextIO | None = None, *, width: int | None = None) -> None:
    """Print where a merge stands: counts, memory, elapsed time, what is pending, the last error, what to run."""
    out = console(stream or sys.stdout, width=width)
    style = _STATE_STYLE.get(report.state, "white")
    out.print(f"[bold]{escaped(report.out_dir)}[/bold]: [{style}]{report.state}[/{style}] (from the {report.source})")
    table = Table(box=box.SIMPLE_HEAD, show_header=True, header_style="bold", pad_edge=False, show_edge=False)
    table.add_column("")
    table.add_column("done", justify="right")
    table.add_column("total", justify="right")
    table.add_column("")
    details = report.details
    merged = details is None or not details.counts_only  # a kind that writes no shards has only its own counts
    pct = 100.0 * report.bytes_done / report.bytes_total if report.bytes_total else 100.0
    if merged:
        table.add_row("shards", str(report.shards_done), str(report.shards_total), f"{pct:.0f} % of bytes")
    if report.units_total and merged:  # a file written in place: what an interruption keeps
        table.add_row("units", str(report.units_done), str(report.units_total), "written in place")
    if merged:
        table.add_row("tensors", str(report.tensors_done), str(report.tensors_total), "")
    for label, done, total, what in details.counts if details is not None else ():  # the kind's own counts
        table.add_row(label, str(done), str(total), what)
    if merged:
        table.add_row("bytes", format_size(report.bytes_done), format_size(report.bytes_total), "")
    if report.phase is not None:  # a run of several phases: which one, and how far it is
        from resumerge.merge.store.statusview import phase_line

        show_field(out, "phase", phase_line(report.phase))
    out.print(table)
    if report.unit_files and merged:  # several files written in place together (a GGUF release): each one's units
        from resumerge.merge.store.statusview import file_line

        for file in report.unit_files:
            show_field(out, "file", file_line(file))
    for label, text in details.rows if details is not None else ():  # what the kind of run adds
        show_field(out, label, text)
    if report.peak_rss or report.budget:
        parts = [f"budget {format_size(report.budget)}"] if report.budget else []
        # The peak is recorded when a process ends its run; a killed process leaves none.
        parts.append(f"peak {format_size(report.peak_rss)}" if report.peak_rss else "peak not recorded")
        parts.append(f"{report.adaptations} governor adaptation(s)")
        show_field(out, "memory", ", ".join(parts))
    for line in report.adaptation_events:
        show_field(out, "", line)
    if report.streamed:
        f = report.streamed
        show_field(out, "streamed", f"{format_size(int(f['fetched']))} fetched of {format_size(int(f['needed']))} "
               f"needed at {format_size(int(f['rate']))}/s ({int(f['requests'])} range requests)")
    if report.formats:
        from resumerge.merge.plan.roles import formats_line

        show_field(out, "formats", formats_line(report.formats))
    if report.inputs is not None:
        show_field(out, "inputs", str(report.inputs["summary"]))
    for line in report.plan_notes:
        show_field(out, "note", line)
    if report.elapsed_seconds is not None:
        seconds = report.elapsed_seconds
        show_field(out, "elapsed", format_duration(seconds) if seconds >= 90 else f"{seconds:.1f} s")
    if report.url:
        show_field(out, "repo", report.url)
    for line in report.nodes:  # a run on a Ray cluster: what each node made
        show_field(out, "node", line.removeprefix("node "))
    if report.uncommitted:
        show_field(out, "uploading", ", ".join(report.uncommitted) + " (staged here, not yet in a commit)")
    pending = [f.name for f in report.files if f.status != "done" and f.name not in report.uncommitted]
    if pending:
        more = f" and {len(pending) - 6} more" if len(pending) > 6 else ""
        show_field(out, "pending", ", ".join(pending[:6]) + more)
    if report.last_error:
        show_field(out, "last error", report.last_error, style="bold red")
    if report.resume_command:
        show_field(out, "finish with", report.resume_command)


def show_field(out: Console, label: str, text: str, *, style: str = "bold") -> None:
    """One ``label  text`` line; long text runs on rather than wrapping, so logs keep one line per fact."""
    out.print(Text.assemble((f"{label:<12} ", style), text))  # a space after a longer label too


def show_recipe_status(report: RecipeStatus, stream: TextIO | None = None, *, width: int | None = None) -> None:
    """Print where a recipe stands: one row per stage, then the details of the stage in progress."""
    out = console(stream or sys.stdout, width=width)
    style = _STATE_STYLE.get(report.state, "white")
    out.print(f"[bold]{escaped(report.out_dir)}[/bold]: recipe [{style}]{report.state}[/{style}], "
              f"{report.stages_done} of {len(report.stages)} stages done (from the {report.source})")
    table = Table(box=box.SIMPLE_HEAD, show_header=True, header_style="bold", pad_edge=False)
    for name, justify in (("stage", "left"), ("state", "left"), ("shards", "right"), ("bytes", "right"),
                          ("output", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for stage in report.stages:
        shards = f"{stage.shards_done}/{stage.shards_total}" if stage.shards_total else ""
        written = f"{format_size(stage.bytes_done)}/{format_size(stage.bytes_total)}" if stage.bytes_total else ""
        table.add_row(stage.label + (" (final)" if stage.final else ""), stage.state, shards, written,
                      escaped(stage.out_dir))
    out.print(table)
    if report.last_error:
        out.print(Text.assemble(("last error: ", "bold red"), report.last_error))
    if report.current is not None:
        out.print("stage in progress:")
        # The stage is finished by resuming the recipe, never the stage's own folder: drop its command.
        show_status(replace(report.current, resume_command=None), stream or sys.stdout, width=width)


def escaped(text: str) -> str:
    """``text`` with rich's markup escaped."""
    from rich.markup import escape

    return escape(text)

"""Everything resumerge draws for a person: progress, status and plan tables, verify results. The only module
using rich.

Progress has three modes. ``live`` redraws bars in place (overall bytes with speed and ETA, the shard being
written, RAM in use against the budget, and for a run on the network both directions: MB/s down and up, bytes
fetched and committed, the network's ETA): on an interactive terminal, or in a notebook when rich can draw there
(ipywidgets). ``plain`` prints one self-contained line at most every ``interval`` seconds (and when the merge
ends), with no control codes, so log files and captured notebook output stay readable: whenever output is not an
interactive terminal, when rich's ``TTY_INTERACTIVE=0`` or ``TERM=dumb`` says so, and for commands run from a
notebook cell (``!resumerge ...`` gets a pseudo-terminal that cannot redraw lines). ``quiet`` prints nothing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import IO, TYPE_CHECKING, TextIO

from rich import box
from rich.console import Console, RenderableType
from rich.constrain import Constrain
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Column, Table
from rich.text import Text

from resumerge.cli.statusshow import console as console
from resumerge.cli.statusshow import escaped, show_field
from resumerge.cli.statusshow import show_any_status as show_any_status
from resumerge.cli.statusshow import show_recipe_status as show_recipe_status
from resumerge.cli.statusshow import show_status as show_status
from resumerge.cli.trafficline import TrafficRates, traffic_line
from resumerge.machine.memory.sizes import format_duration, format_size

if TYPE_CHECKING:  # status must stay fast: these are imported only for annotations
    from resumerge.analyses.check.report import CheckReport
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.merge.engine.traffic import Traffic
    from resumerge.merge.store.integrity import VerifyReport
    from resumerge.runs.recipes.estimate import RecipeEstimate

# Set in the environment of every process a Jupyter kernel (JPY_PARENT_PID) or Colab runtime starts.
_NOTEBOOK_ENV = ("JPY_PARENT_PID", "COLAB_RELEASE_TAG")
PLAIN_INTERVAL = 15.0
# Seconds between the live bars' updates: rich redraws them 10 times a second, and updating them per tensor cost
# more than merging a tiny tensor.
LIVE_INTERVAL = 0.1


def progress_mode(out: Console, quiet: bool = False) -> str:
    """``"quiet"``, ``"live"`` or ``"plain"`` for progress drawn on ``out`` (see the module docstring)."""
    if quiet:
        return "quiet"
    forced = os.environ.get("TTY_INTERACTIVE")  # rich's switch: 0 never animates, 1 always does
    if forced in ("0", "1"):
        return "live" if forced == "1" else "plain"
    if out.is_jupyter:
        # rich draws live output in notebooks through ipywidgets (Colab has it); without it, plain lines.
        return "live" if importlib.util.find_spec("ipywidgets") is not None else "plain"
    # FORCE_COLOR (set by Jupyter kernels, some CI systems) makes rich call any stream a terminal; colours are
    # welcome there, but only a real TTY can redraw lines.
    if out.is_interactive and _isatty(out.file) and not any(os.environ.get(v) for v in _NOTEBOOK_ENV):
        return "live"
    return "plain"


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False


# Cells the live rows need besides their detail: label, the bar at its narrowest, percentage, bytes, speed, time
# left, and the spaces between them; one more so a row never ends in the last column.
_FIXED_COLUMNS_WIDTH = 5 + 8 + 4 + len("141.1/141.1 MB") + len("123.4 MB/s") + len("0:00:00") + 6 + 1
_DETAIL_MIN = 8


class _MergeProgress(Progress):
    """Rich progress with lines under the bars: the network's two directions, memory in use against the budget."""

    def __init__(self, lines: Callable[[], list[str]], out: Console, *columns: object,
                 **kwargs: object) -> None:
        self._lines, self._out = lines, out  # before Progress.__init__, which may render already
        super().__init__(*columns, console=out, **kwargs)  # type: ignore[arg-type]

    def get_renderables(self) -> Iterable[RenderableType]:
        table = self.make_tasks_table(self.tasks)
        # Every row must fit on one terminal line: a row the terminal wraps is taller than rich counts, so the
        # redraw leaves a stale copy behind (and at 80 columns "141.1/141.1 MB" was split over two lines). The
        # figures never wrap; the bar gives way first, then the detail (a shard's name) is cut with an ellipsis.
        table.columns[-1].max_width = max(_DETAIL_MIN, self._out.width - _FIXED_COLUMNS_WIDTH)
        yield Constrain(table, self._out.width - 1)
        for line in self._lines():
            yield Text(line, style="dim")


class StepBar:
    """A live bar of ``total`` steps labelled ``label`` on ``out``, with the steps done, the time left and a detail
    (``resumerge check``'s forward pass: :mod:`resumerge.cli.checkprogress`)."""

    def __init__(self, out: Console, label: str, total: int, done: int) -> None:
        self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             TextColumn("{task.fields[detail]}"), console=out, transient=False)
        self._task = self._bar.add_task(label, total=total, completed=done, detail="")
        self._bar.start()

    def update(self, done: int, detail: str) -> None:
        """Show ``done`` steps and ``detail``."""
        self._bar.update(self._task, completed=done, detail=detail)

    def stop(self) -> None:
        """Show the bar full and stop redrawing it."""
        self._bar.update(self._task, completed=self._bar.tasks[0].total)
        self._bar.stop()


class ProgressReporter:
    """The engine's Reporter for people: live bars, plain log lines, or nothing (see the module docstring).

    Besides the Reporter protocol it accepts optional hooks the engine may call: :meth:`shard_started` (adds
    a bar for the shard being written), :meth:`memory_budget` (RAM is then shown against the budget) and
    :meth:`traffic` (a run on the network: both directions are shown, read from the snapshots it gives). RAM in
    use is read with ``rss`` (default: the anonymous memory of this process, what the budget counts).
    ``mode`` forces ``"live"``, ``"plain"`` or ``"quiet"``; ``clock`` exists for tests.
    """

    def __init__(
        self,
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        mode: str | None = None,
        interval: float = PLAIN_INTERVAL,
        budget: int | None = None,
        rss: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        width: int | None = None,
    ) -> None:
        self._console = console(stream, width=width)
        self.mode = mode or progress_mode(self._console, quiet)
        if self.mode not in ("live", "plain", "quiet"):
            raise ValueError(f"unknown progress mode {self.mode!r}")
        self._interval = interval
        self._budget = budget
        self._rss = rss
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._last_line = self._started
        self._dirty = False
        self._bytes = self._session_bytes = self._total = 0
        self._shown_bytes, self._next_bars = 0, 0.0  # what the live bars show, and when they are fed next
        self._tensors = self._tensors_total = 0
        self._shard: str | None = None
        self._progress: _MergeProgress | None = None
        self._overall: TaskID | None = None
        self._shard_task: TaskID | None = None
        self._traffic: Callable[[], Traffic] | None = None
        self._rates = TrafficRates()

    # -- the Reporter protocol ------------------------------------------------------------------------------

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        """Show the bars (or a plain line) once the plan and what is already committed are known."""
        with self._lock:
            self._bytes, self._total = done_bytes, total_bytes
            self._tensors, self._tensors_total = done_tensors, total_tensors
            self._session_bytes = 0
            self._shown_bytes, self._next_bars = done_bytes, 0.0
            self._started = self._last_line = self._clock()
            if self.mode == "plain":
                already = f"; {format_size(done_bytes)} already committed" if done_bytes else ""
                self._print(f"merging {total_tensors - done_tensors} of {total_tensors} tensors, "
                            f"{format_size(total_bytes - done_bytes)} to write{already}")
            elif self.mode == "live":
                self._start_live()

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Count one finished output tensor of ``nbytes``."""
        with self._lock:
            self._bytes += nbytes
            self._session_bytes += nbytes
            self._tensors += 1
            self._dirty = True
            if self._progress is not None and self._overall is not None:
                if self._clock() >= self._next_bars:  # the bars redraw 10 times a second: feed them as often
                    self._advance_bars()
            elif self.mode == "plain" and self._clock() - self._last_line >= self._interval:
                self._print(self._progress_line())

    def file_done(self, name: str, kind: str) -> None:
        """Note a committed file; in plain mode a line when ``interval`` has passed since the last one."""
        with self._lock:
            if self.mode == "plain" and kind == "shard" and self._clock() - self._last_line >= self._interval:
                self._print(f"committed {name}; " + self._progress_line())

    def message(self, text: str) -> None:
        """Show a note from the engine (above the bars when live)."""
        with self._lock:
            if self.mode != "quiet":
                self._console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        """Stop the live display; in plain mode print where the merge got to if that was not printed yet."""
        with self._lock:
            if self._progress is not None:
                self._advance_bars()
                if self._overall is not None and self._tensors >= self._tensors_total:
                    # Shard headers are in the total but never in a tensor's bytes: show a finished bar as full.
                    self._progress.update(self._overall, completed=max(1, self._total))
                    for task in self._progress.tasks:  # the last shard too: it is written, header and all
                        if task.id == self._shard_task:
                            self._progress.update(task.id, completed=task.total)
                self._progress.stop()
                # A recipe starts the display again for its next stage, on a new Progress with new task ids.
                self._progress, self._overall, self._shard_task = None, None, None
            elif self.mode == "plain" and self._dirty:
                self._print(self._progress_line())

    # -- optional hooks -------------------------------------------------------------------------------------

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None:
        """The writer began shard ``name`` of ``nbytes`` bytes and ``tensors`` tensors."""
        with self._lock:
            self._shard = name
            if self._progress is None:
                return
            self._advance_bars()  # the bytes not shown yet are the shard before's
            if self._shard_task is None:
                self._shard_task = self._progress.add_task("shard", total=nbytes, detail=name)
            else:
                self._progress.reset(self._shard_task, total=nbytes, detail=name)

    def memory_budget(self, nbytes: int) -> None:
        """The merge's RAM budget, shown beside RAM in use."""
        self._budget = nbytes

    def traffic(self, read: Callable[[], Traffic]) -> None:
        """The run's network counters, read whenever progress is drawn."""
        self._traffic = read

    # -- internals (called with the lock held) --------------------------------------------------------------

    def _start_live(self) -> None:
        self._progress = _MergeProgress(
            self._lines,
            self._console,
            TextColumn("[bold]{task.description:<5}", table_column=Column(no_wrap=True)),
            BarColumn(table_column=Column(min_width=8)),
            TaskProgressColumn(table_column=Column(no_wrap=True)),
            DownloadColumn(table_column=Column(no_wrap=True)),
            TransferSpeedColumn(table_column=Column(no_wrap=True)),
            TimeRemainingColumn(table_column=Column(no_wrap=True)),
            TextColumn("{task.fields[detail]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            transient=False,
        )
        self._overall = self._progress.add_task("merge", total=max(1, self._total), completed=self._bytes,
                                                detail=self._tensor_detail())
        self._progress.start()

    def _advance_bars(self) -> None:
        """Move the live bars to the bytes and tensors done (tensors come by the thousand a second: the bars are
        fed at their redraw rate, not per tensor)."""
        if self._progress is None or self._overall is None:
            return
        advance, self._shown_bytes = self._bytes - self._shown_bytes, self._bytes
        self._next_bars = self._clock() + LIVE_INTERVAL
        self._progress.update(self._overall, advance=advance, detail=self._tensor_detail())
        if self._shard_task is not None:
            self._progress.update(self._shard_task, advance=advance)

    def _tensor_detail(self) -> str:
        return f"{self._tensors}/{self._tensors_total} tensors"

    def _lines(self) -> list[str]:
        return [line for line in (self._traffic_line(), self._memory_line()) if line]

    def _traffic_line(self) -> str | None:
        if self._traffic is None:
            return None
        now = self._traffic()
        return traffic_line(now, *self._rates.add(self._clock(), now))

    def _memory_line(self) -> str | None:
        used = self._read_rss()
        if used is None:
            return None
        budget = f" of a {format_size(self._budget)} budget" if self._budget else ""
        return f"RAM {format_size(used)}{budget}"

    def _read_rss(self) -> int | None:
        if self._rss is None:
            from resumerge.machine.memory import SystemProbe

            self._rss = SystemProbe().rss
        try:
            return self._rss()
        except OSError:
            return None

    def _progress_line(self) -> str:
        elapsed = max(1e-6, self._clock() - self._started)
        rate = self._session_bytes / elapsed
        complete = self._tensors >= self._tensors_total
        # Shard headers count in the total but in no tensor's bytes: a finished merge shows the total.
        done = self._total if complete else min(self._bytes, self._total)
        pct = 100.0 * done / self._total if self._total else 100.0
        parts = [f"{pct:.0f} % ({format_size(done)} of {format_size(self._total)}, "
                 f"{self._tensors} of {self._tensors_total} tensors)"]
        if self._session_bytes:
            parts.append(f"{format_size(int(rate))}/s")
            if self._tensors < self._tensors_total:
                parts.append(f"about {format_duration(max(0, self._total - self._bytes) / rate)} left")
        memory = self._memory_line()
        if memory:
            parts.append(memory)
        network = self._traffic_line()
        return "progress: " + ", ".join(parts) + (f"; {network}" if network else "")

    def _print(self, line: str) -> None:
        self._console.print(line, markup=False, highlight=False)
        self._last_line = self._clock()
        self._dirty = False


# -- status, plan, verify -----------------------------------------------------------------------------------


def show_estimate(result: Estimate | RecipeEstimate, stream: TextIO | None = None) -> None:
    """``resumerge plan``: one merge's estimate, or a recipe's, stage by stage."""
    from resumerge.runs.recipes.estimate import RecipeEstimate

    if not isinstance(result, RecipeEstimate):
        show_plan(result, stream)
        return
    for stage in result.stages:
        print(stage.heading, file=stream or sys.stdout)
        show_plan(stage.estimate, stream)
        print(file=stream or sys.stdout)


_LINE_STYLES = MappingProxyType({"field": "bold", "note": "dim"})
_VERDICT_STYLES = MappingProxyType({"head": "", "fits": "bold green", "unfit": "bold red", "reason": ""})


def show_plan(estimate: Estimate, stream: TextIO | None = None, *, width: int | None = None) -> None:
    """Print the plan summary, its costs here and the verdict with its reasons
    (:func:`~resumerge.analyses.estimate.costs.estimate_lines`, the text an estimate shows in a notebook too)."""
    from resumerge.analyses.estimate.costs import estimate_lines  # imported here: status's rendering never needs it

    out = console(stream or sys.stdout, width=width)
    for line in estimate_lines(estimate):
        if line.label:
            show_field(out, line.label, line.text, style=_LINE_STYLES[line.kind])
        else:
            out.print(Text(line.plain(), style=_VERDICT_STYLES[line.kind]))


def show_verify(report: VerifyReport, stream: TextIO | None = None) -> None:
    """Print a verify report for a person."""
    out = console(stream or sys.stdout)
    if report.ok:
        units = f" and {report.units_checked} units written in place" if report.units_checked else ""
        out.print(f"[green]ok[/green]: {report.checked} committed files{units} ({format_size(report.bytes_checked)}) "
                  f"match their checksums" + (f"; {report.pending} still pending" if report.pending else ""))
        return
    for d in report.damaged:
        out.print(f"[red]damaged[/red]: {escaped(d.name)}: {escaped(d.problem)}")
    out.print(f"repair with: {escaped(report.resume_command)}")


def show_check(report: CheckReport, stream: TextIO | None = None, *, width: int | None = None) -> None:
    """Print a check's report for a person: the models' figures (each model by a short name that tells it from
    the others, its full path listed once below), the verdict, its reasons and thresholds; the table at its natural
    width (never a name or a header cut), the rest a line each."""
    from resumerge.analyses.check.names import in_short, short_names

    out = console(stream or sys.stdout, width=width)
    paths = [m.path for m in report.models]
    names = short_names(paths)
    table = Table("role", "model", "NLL", "KL(this‖merge)", "KL p95", "top-1", "max drift", box=box.SIMPLE)
    for m, name in zip(report.models, names):
        def num(x: float | None, f: str = ".4f") -> str:
            return "-" if x is None else format(x, f)
        table.add_row(m.role, escaped(name), num(m.nll), num(m.kl, ".4g"), num(m.kl_p95, ".4g"),
                      num(m.top1, ".1%"), num(max(m.drift), ".3g") if m.drift else "-")
    from rich.measure import Measurement

    # At its natural width, wider than the terminal where it must be: a name or a header cut to "…" at 80
    # columns told two parents apart by nothing (issue 87); a terminal wraps a long line, it never loses a letter.
    natural = Measurement.get(out, out.options.update_width(10_000), table).maximum
    wide = out if natural <= out.width else console(stream or sys.stdout, width=natural)
    wide.print(table)
    listed: set[str] = {paths[0]}  # the merge is MODEL, as given: the legend names the others' paths
    for m, name in zip(report.models, names):
        if m.path not in listed:
            listed.add(m.path)
            other = "" if m.own else " (not named by the merge's record: only compared with)"
            out.print(f"  {escaped(name)}: {escaped(m.path)}{other}", style="dim")
    out.print(f"{report.sequences} sequences, {report.tokens} predicted tokens; parameters: "
              + ", ".join(f"{escaped(k)} {v:,}" for k, v in report.static.parameters.items()))
    colour = {"works": "green", "no_effect": "yellow", "broken": "red"}[report.verdict]
    layer = f" (layer {report.broken_layer})" if report.broken_layer is not None else ""
    if report.compared is not None:
        out.print(f"compared: {escaped(report.compared)}")
    if report.proof is not None:
        out.print(f"inputs: {escaped(report.proof)}", style="dim")
    out.print(f"verdict: [{colour}]{report.verdict.replace('_', ' ')}[/{colour}]{layer}")
    for reason in report.reasons:
        out.print(f"  - {escaped(in_short(reason, paths, names))}")
    out.print("thresholds: " + ", ".join(f"{k} {v:g}" for k, v in report.thresholds.items()), style="dim")
    if report.chart is not None:
        from resumerge.analyses.check.chart import COLOUR_NAMES

        legend = ", ".join(f"{COLOUR_NAMES[i % len(COLOUR_NAMES)]} {m.role} {name}"
                           for i, (m, name) in enumerate(zip(report.models[1:], names[1:])))
        out.print(f"drift per layer: {escaped(report.chart)} ({escaped(legend)})")
    if report.prompts:
        out.print(f"prompts: {escaped(report.prompts)}", style="dim")
    if report.vocabulary is not None:  # models whose vocabularies differ: what the figures were compared over
        out.print(f"the vocabularies differ: {escaped(report.vocabulary)}")
    if report.card is not None:
        out.print(f"model card: {escaped(report.card)}")


def show_error(line: str, stream: TextIO | None = None) -> None:
    """Print a one-line error."""
    console(stream).print(Text.assemble(("error:", "red"), " ", line))

"""Where a merge stands, read without torch or sqlite-utils (``resumerge status`` answers in well under 0.5 s).
A run still planning (before its plan is in the ledger) is "planning", from its planning mark.

Reads the ledger through :mod:`resumerge.merge.store.ledger_read` (standard library only), or — when the state dir is
gone — OUT's manifest. A run recorded as ``running`` whose lock no process holds is reported as ``interrupted``; an
unfinished run carries the exact command that finishes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir
from resumerge.errors import LedgerError, NothingRecordedError
from resumerge.machine.planning import killed_while_planning, planning_since
from resumerge.merge.store.ledger_read import LEDGER_NAME as LEDGER_NAME
from resumerge.merge.store.ledger_read import read_merge_status
from resumerge.merge.store.manifest import MANIFEST_NAME
from resumerge.merge.store.nodestats import node_line
from resumerge.merge.store.outgone import refuse_gone

# The kind-specific keys of the JSON that the version before kinds' details printed for every run (null where they
# did not apply): still printed so, that a script reading them keeps working. A new kind's keys are its own.
_EARLIER_DETAIL_KEYS = ("modules_total", "modules_done", "module_current", "prepass_layers")


@dataclass(frozen=True)
class FileStatus:
    """One planned output file."""

    name: str
    kind: str
    status: str
    bytes: int | None


@dataclass(frozen=True)
class Details:
    """What one kind of run adds to its status (a kind makes it; ``status`` shows it without knowing the kind):
    ``counts`` (label, done, total, what) join the counts table, ``rows`` (label, text) are lines of their own,
    and ``data`` is what ``status --json`` prints for them."""

    counts: tuple[tuple[str, int, int, str], ...] = ()
    rows: tuple[tuple[str, str], ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)
    # The kind's counts are the whole table: a kind that writes no shards (an evaluation) shows no shards, tensors
    # or bytes, whose "100 % of bytes" of nothing said the opposite of where it was.
    counts_only: bool = False


@dataclass(frozen=True)
class StatusReport:
    """The state of one output directory's merge; ``source`` says whether it came from the ledger or manifest."""

    out_dir: str
    state: str
    source: str
    tensors_total: int
    tensors_done: int
    shards_total: int
    shards_done: int
    bytes_total: int
    bytes_done: int
    files: tuple[FileStatus, ...] = ()
    # The units of the files written in place (a GGUF output in a local OUT: its header, then groups of tensors up
    # to --out-shard-size), those of committed files counted done; 0 of 0 where every file is committed whole.
    units_total: int = 0
    units_done: int = 0
    # Where several files are written in place together (a GGUF release): each one's (name, units done, units),
    # as the ledger lists them (by name), those of a committed file all done; empty for one file.
    unit_files: tuple[tuple[str, int, int], ...] = ()
    last_error: str | None = None
    peak_rss: int | None = None
    adaptations: int = 0
    elapsed_seconds: float | None = None
    events: tuple[str, ...] = field(default=())
    # The run's RAM budget (from its latest start), the latest governor adaptations, and for an unfinished
    # run the command that finishes it (None while done, or while another process is merging).
    budget: int | None = None
    adaptation_events: tuple[str, ...] = ()
    # How many reservations the RAM governor granted in the run's latest start, recorded when it ended (None before,
    # and on a cluster's driver): one per unit of work (a tensor, a group of small tensors of one shard, a row chunk)
    # and per hub read-ahead grant; and the largest estimate one of them reserved (bytes).
    admissions: int | None = None
    largest_admission: int | None = None
    resume_command: str | None = None
    # hf:// OUT: the repo's web address, and planned files staged on this machine but not yet in a commit
    # (uploading or uploaded).
    url: str | None = None
    uncommitted: tuple[str, ...] = ()
    # Hub inputs read by HTTP Range (issue 15): the latest figures of the run — fetched, needed, requests, rate
    # (bytes/s), refreshed_urls, retries — or None when nothing was streamed.
    streamed: dict[str, float] | None = None
    # What the plan decided that the user must hear (vocabulary rows cut by --unsafe-truncate-embeddings, …).
    plan_notes: tuple[str, ...] = ()
    # A run on a cluster (--executor ray): one line per node with its shards, bytes and rate.
    nodes: tuple[str, ...] = ()
    # A run with a quantized input or output: the plan's stored format and role counts (weight, companion, other)
    # of each input model and of the output, as it recorded them when it started; None for a plain run.
    formats: dict[str, Any] | None = None
    # What became of every input tensor of a merge (resumerge.merge.plan.accounting's JSON, with its one-line
    # ``summary``), as the run's latest start recorded it; None when no run recorded it.
    inputs: dict[str, Any] | None = None
    # The kind of run (as the run recorded it, or as the API derived it for a run recorded before runs recorded
    # it), and what that kind adds (its modules, its forward pass, ...); None where it adds nothing.
    kind: str | None = None
    details: Details | None = None
    # A run of several phases (an importance pass before its merge: resumerge.merge.engine.phasing): where it is, as
    # its latest phase event recorded it ({"index", "of", "name"} and, within a phase that counts its steps, "done",
    # "total", "unit"); None for a run whose merge is all it does.
    phase: dict[str, Any] | None = None
    # The run's recorded text, only for the API to derive the kind of a run that recorded none (a ledger of the
    # version before kinds were recorded, or OUT's manifest alone, whose bytes stay as they were); never printed.
    recorded_text: str | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        """The rows of ``resumerge status``'s table as text (see :func:`status_rows`)."""
        return status_text(self)

    def _repr_html_(self) -> str:
        """The same rows as an HTML table, for a notebook."""
        return status_html(self)

    def to_json(self) -> dict[str, Any]:
        """The JSON form printed by ``status --json``."""
        doc = {k: v for k, v in asdict(self).items() if k not in ("details", "recorded_text")}
        doc.update(dict.fromkeys(_EARLIER_DETAIL_KEYS))
        doc.update(self.details.data if self.details is not None else {})
        doc["files"] = [asdict(f) for f in self.files]
        doc["events"] = list(self.events)
        doc["adaptation_events"] = list(self.adaptation_events)
        doc["uncommitted"] = list(self.uncommitted)
        doc["plan_notes"] = list(self.plan_notes)
        doc["nodes"] = list(self.nodes)
        return doc


def read_status(out_dir: str | os.PathLike[str], state: StateDir) -> StatusReport:
    """Status of the merge into ``out_dir`` (its ledger under ``state``); raises :class:`LedgerError` when there
    is no record of one.

    For ``hf://`` OUT the ledger answers when this machine has it, else the repo's manifest (one small request).
    """
    where = state.run(out_dir)
    rdir, ledger, command = where.run_dir, where.ledger, where.resume_command
    since = planning_since(rdir)
    if since is not None:
        return _planning(out_dir, ledger, rdir, command, since)
    if is_hub_target(out_dir):
        return _hub_status(str(out_dir), ledger, rdir, command)
    manifest = Path(out_dir) / MANIFEST_NAME
    if ledger.exists():
        try:
            report = _from_ledger(ledger, rdir, str(out_dir), command)
        except LedgerError:
            if not manifest.is_file():
                raise
            report = None  # a damaged ledger is never trusted: OUT's manifest tells the same story
        if report is not None:
            _check_still_there(report, state)
            return report
    if manifest.is_file():
        return _from_manifest(manifest, str(manifest), str(out_dir), command)
    killed = killed_while_planning(str(out_dir), rdir)
    if killed is not None:
        raise killed
    raise NothingRecordedError.of(out_dir)


def recorded(found: StatusReport | None, nothing: str) -> StatusReport:
    """The status an analysis found in its own folder (:mod:`resumerge.api.analyses`), or, where it found none, the
    one refusal ``status`` gives for a folder that holds nothing (``nothing`` says what it never recorded)."""
    if found is None:
        raise NothingRecordedError(nothing)
    return found


def _planning(out_dir: str | os.PathLike[str], ledger: Path, rdir: Path, command: str, since: float) -> StatusReport:
    """A run or resume planning now (:mod:`resumerge.machine.planning`): what the ledger holds, if anything, with
    the state "planning" until the run records its plan and goes on (then the ledger's own state)."""
    report = None
    if ledger.exists():
        with contextlib.suppress(LedgerError):  # a damaged ledger: the run being planned sets it aside
            report = _from_ledger(ledger, rdir, str(out_dir), command)
    if report is not None and report.state in ("running", "done"):  # planned already (a done run: ending now)
        return report
    elapsed = max(0.0, time.time() - since)
    if report is not None:
        return replace(report, state="planning", resume_command=None, elapsed_seconds=elapsed)
    return StatusReport(out_dir=str(out_dir), state="planning", source="state dir", tensors_total=0, tensors_done=0,
                        shards_total=0, shards_done=0, bytes_total=0, bytes_done=0, elapsed_seconds=elapsed)


def _last_work(updated_at: float | None, rdir: Path) -> float:
    """When an interrupted run last did work: its record's last update, or later the newest file it kept in its
    run folder's subfolders (a transplant's approximated batches, an extraction's factors, staged shards: work
    done between two updates of the record, which a SIGKILL leaves unrecorded; the folder's own files, the ledger
    and its lock, are left out: a reader touches them)."""
    newest = updated_at or time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(rdir):
            if not entry.is_dir(follow_symlinks=False):
                continue
            for root, _, names in os.walk(entry.path):
                for name in names:
                    with contextlib.suppress(OSError):
                        newest = max(newest, os.stat(os.path.join(root, name)).st_mtime)
    return newest


def _check_still_there(report: StatusReport, state: StateDir) -> None:
    """Refuse a ledger's story about an OUT that is no longer there (status reported the old state of files that
    do not exist): :func:`~resumerge.merge.store.outgone.refuse_gone`."""
    refuse_gone(report.out_dir, sum(1 for f in report.files if f.status == "done"), state)


def _from_ledger(path: Path, rdir: Path, out_dir: str, command: str) -> StatusReport | None:
    from resumerge.machine.runlock import is_locked

    rows = read_merge_status(path)
    if rows is None:
        return None
    run, files = rows.record.run, rows.record.files
    state = run.state
    if state == "running" and not is_locked(rdir):
        state = "interrupted"
    shards = [f for f in files if f.kind == "shard"]
    committed = {f.name for f in shards if f.status == "done"}
    # Units written of a file not committed yet count in its bytes: an interruption keeps them.
    written = [u for u in rows.units if u.status == "done" and u.file not in committed]
    memory = _json_object(rows.memory.data if rows.memory else None)  # parsed once for its three figures
    return StatusReport(
        out_dir=out_dir,
        state=state,
        source="ledger",
        tensors_total=rows.tensors_total,
        tensors_done=rows.tensors_done,
        shards_total=len(shards),
        shards_done=sum(1 for f in shards if f.status == "done"),
        bytes_total=sum(f.planned_bytes or 0 for f in shards),
        bytes_done=sum(f.bytes or 0 for f in shards if f.status == "done") + sum(u.end - u.start for u in written),
        files=tuple(FileStatus(f.name, f.kind, f.status, f.bytes) for f in files),
        units_total=len(rows.units),
        units_done=len(written) + sum(1 for u in rows.units if u.file in committed),
        unit_files=_unit_files(rows.units, committed),
        last_error=run.last_error,
        peak_rss=run.peak_rss or None,
        adaptations=run.adaptations,
        # A running run's record is updated when its state changes, not as time passes: count to now; a run
        # whose process is gone, to the last work it kept (never less than it showed while running).
        elapsed_seconds=max(0.0, (time.time() if state == "running" else _last_work(run.updated_at, rdir)
                                  if state == "interrupted" else run.updated_at or time.time())
                            - (run.created_at or time.time())),
        events=tuple(f"{e.kind}: {e.message}" for e in rows.events),
        budget=_count(memory, "budget"),
        admissions=_count(memory, "admissions"),
        largest_admission=_count(memory, "largest"),
        adaptation_events=tuple(a.message for a in rows.adaptations),
        resume_command=None if state in ("done", "running") else command,
        streamed=_json_object(rows.stream.data if rows.stream else None),
        plan_notes=rows.plan_notes,
        inputs=json.loads(rows.inputs.data or "{}") | {"summary": rows.inputs.message} if rows.inputs else None,
        kind=run.kind,
        recorded_text=run.config_text if run.kind is None else None,
        nodes=tuple(node_line(tally, _size) for tally in rows.nodes),
        formats=dict(json.loads(rows.formats.data)) if rows.formats is not None and rows.formats.data else None,
        phase=_json_object(rows.phase.data) if rows.phase is not None else None,
    )


def phase_line(phase: Mapping[str, Any]) -> str:
    """Where a run of several phases is, in words: ``the importance matrix pass over the merge (phase 1 of 2):
    layer 17 of 30 done``; the merge's (the last) says no more, its shards, tensors and bytes are the counts."""
    line = f"{phase.get('name')} (phase {int(phase.get('index', 0)) + 1} of {phase.get('of')})"
    if "done" in phase:
        line += f": {phase.get('unit')} {phase.get('done')} of {phase.get('total')} done"
    return line


def _json_object(data: str | None) -> dict[str, Any] | None:
    """An event's JSON ``data`` when it is an object; None when there is none or it is not."""
    try:
        value = json.loads(data) if data else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _count(doc: dict[str, Any] | None, key: str) -> int | None:
    """The positive integer ``key`` of a memory event's data; None when it has none."""
    value = doc.get(key) if doc is not None else None
    return value if isinstance(value, int) and value > 0 else None


def _hub_status(out: str, ledger: Path, rdir: Path, command: str) -> StatusReport:
    from dataclasses import replace

    from resumerge.merge.store.hubstatus import remote_manifest_bytes, repo_url, staged_names

    report = None
    if ledger.exists():
        try:
            report = _from_ledger(ledger, rdir, out, command)
        except LedgerError:
            report = None  # a damaged ledger is never trusted: the repo's manifest tells the same story
    if report is None:
        data, where = remote_manifest_bytes(out, command)
        report = _from_manifest(data, where, out, command)
    pending = [f.name for f in report.files if f.status != "done"]
    return replace(report, url=repo_url(out), uncommitted=staged_names(rdir, pending))


def _from_manifest(source: Path | bytes, where: str, out_dir: str, command: str) -> StatusReport:
    try:
        data = source if isinstance(source, bytes) else source.read_bytes()
        doc = json.loads(data.decode("utf-8"))
        planned = list(doc["planned"])
        committed = dict(doc["committed"])
        sizes = {str(k): int(v) for k, v in doc["shard_sizes"].items()}
        tensors_total = int(doc["tensors_total"])
        counts = {str(k): int(v) for k, v in doc["shard_tensors"].items()}
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise LedgerError(f"the manifest {where} is unreadable ({exc})", path=where) from None
    shards = [n for n in planned if n in sizes]
    state = "done" if doc.get("state") == "done" else "interrupted"
    return StatusReport(
        out_dir=out_dir,
        state=state,
        source="manifest",
        tensors_total=tensors_total,
        tensors_done=sum(counts.get(n, 0) for n in shards if n in committed),
        shards_total=len(shards),
        shards_done=sum(1 for n in shards if n in committed),
        bytes_total=sum(sizes.values()),
        bytes_done=sum(int(committed[n]["bytes"]) for n in shards if n in committed),
        files=tuple(
            FileStatus(n, "shard" if n in shards else "file", "done" if n in committed else "pending",
                       committed.get(n, {}).get("bytes"))
            for n in planned
        ),
        events=(f"ledger not found: figures from the manifest in {'OUT' if isinstance(source, Path) else 'the repo'}",),
        resume_command=None if state == "done" else command,
        recorded_text=str(doc.get("config_text", "")),
    )


# -- in a notebook: the CLI's rows without rich ------------------------------------------------------------


def _size(n: int | None) -> str:
    """Bytes in decimal units, three significant digits (what the CLI's table shows; store has no memory import)."""
    value, unit = float(n or 0), "bytes"
    for bigger in ("kB", "MB", "GB", "TB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.3g} {unit}"


def _unit_files(units: Sequence[Any], committed: Collection[str]) -> tuple[tuple[str, int, int], ...]:
    """Each file's (name, units done, units) where ``units`` (ledger rows) belong to several files; else none."""
    files: dict[str, list[int]] = {}
    for u in units:
        counts = files.setdefault(u.file, [0, 0])
        counts[0] += u.status == "done" or u.file in committed
        counts[1] += 1
    return tuple((name, done, total) for name, (done, total) in files.items()) if len(files) > 1 else ()


def file_line(file: tuple[str, int, int]) -> str:
    """One file's line of a run writing several in place: ``NAME: 3 of 4 units``."""
    name, done, total = file
    return f"{name}: {done} of {total} units" + (" (written)" if done == total else "")


def status_rows(report: StatusReport) -> list[tuple[str, str]]:
    """(label, value) rows in the CLI's order: counts (the kind's own among them), the kind's rows, memory,
    elapsed time, pending files, the last error and the command that finishes the run."""
    pct = 100.0 * report.bytes_done / report.bytes_total if report.bytes_total else 100.0
    details = report.details or Details()
    rows = [] if details.counts_only else [
        ("shards", f"{report.shards_done} of {report.shards_total} ({pct:.0f} % of bytes)"),
        *([("units", f"{report.units_done} of {report.units_total} (written in place, each kept by a resume)")]
          if report.units_total else []),
        *(("file", file_line(f)) for f in report.unit_files),
        ("tensors", f"{report.tensors_done} of {report.tensors_total}")]
    rows += [(label, f"{done} of {total} {what}") for label, done, total, what in details.counts]
    if report.phase is not None:
        rows.insert(0, ("phase", phase_line(report.phase)))
    if not details.counts_only:
        rows.append(("bytes", f"{_size(report.bytes_done)} of {_size(report.bytes_total)}"))
    if report.inputs is not None:
        rows.append(("inputs", str(report.inputs["summary"])))
    rows.extend(details.rows)
    if report.peak_rss or report.budget:
        memory = [f"budget {_size(report.budget)}"] if report.budget else []
        memory.append(f"peak {_size(report.peak_rss)}" if report.peak_rss else "peak not recorded")
        rows.append(("memory", ", ".join(memory)))
    if report.elapsed_seconds is not None:
        rows.append(("elapsed", f"{report.elapsed_seconds:.1f} s"))
    if report.url:
        rows.append(("repo", report.url))
    pending = [f.name for f in report.files if f.status != "done"]
    if pending:
        rows.append(("pending", ", ".join(pending[:6]) + (f" and {len(pending) - 6} more" if len(pending) > 6
                                                          else "")))
    rows.extend(("node", line.removeprefix("node ")) for line in report.nodes)
    if report.last_error:
        rows.append(("last error", report.last_error))
    if report.resume_command:
        rows.append(("finish with", report.resume_command))
    return rows


def status_text(report: StatusReport) -> str:
    """The report as aligned lines of text, headed ``OUT: state (from the ledger)``."""
    rows = status_rows(report)
    width = max(len(label) for label, _ in rows)
    lines = [f"{report.out_dir}: {report.state} (from the {report.source})"]
    lines += [f"{label.ljust(width)}  {value}" for label, value in rows]
    return "\n".join(lines)


def status_html(report: StatusReport) -> str:
    """The report as an HTML table (what a notebook draws for it)."""
    import html  # here: the command line never draws one

    head = (f"<b>{html.escape(report.out_dir)}</b>: {html.escape(report.state)} "
            f"(from the {html.escape(report.source)})")
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(label)}</th><td style='text-align:left'>"
                   f"{html.escape(value)}</td></tr>" for label, value in status_rows(report))
    return f"<div>{head}<table>{body}</table></div>"

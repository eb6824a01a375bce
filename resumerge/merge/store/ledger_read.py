"""The merge ledger read-only: row types and the queries ``status``, ``verify`` and a recipe's stage check need.

The one place that knows the merge ledger's columns: its writer (:mod:`resumerge.merge.store.ledger`) reads its rows
through :func:`run_row` and :func:`file_rows` too. The recipe ledger's reads live beside its schema, in the
recipes package, on :func:`reading`. Standard library only (sqlite3, json, dataclasses):
``resumerge status`` must not pay for torch or sqlite-utils. Every reader opens the file read-only (``mode=ro``,
never creating or migrating it) and raises :class:`LedgerError` when SQLite cannot read it (damaged, no tables
yet, a WAL a read-only reader cannot recover); each caller decides whether another record (OUT's manifest) can
stand in.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.config.locations import LEDGER_NAME as LEDGER_NAME
from resumerge.errors import LedgerError
from resumerge.merge.store.nodestats import NodeTally, node_tallies


@dataclass(frozen=True)
class RunRow:
    """The ``run`` row of a merge's ledger (the JSON columns decoded)."""

    fingerprint: str
    parts: dict[str, str]
    inputs: dict[str, Any]
    state: str
    last_error: str | None
    peak_rss: int
    adaptations: int
    created_at: float | None
    updated_at: float | None
    config_text: str
    options: dict[str, Any]
    model_dirs: dict[str, str]
    kind: str | None = None  # the kind of run recorded; None: recorded before runs recorded it (migration m005)


@dataclass(frozen=True)
class FileRow:
    """One planned output file: status ``pending`` or ``done``; bytes and sha256 once committed."""

    name: str
    kind: str
    status: str
    bytes: int | None
    planned_bytes: int | None
    sha256: str | None


@dataclass(frozen=True)
class UnitRow:
    """One unit of a file written in place (:mod:`resumerge.merge.store.units`): status ``pending`` or ``done``, with
    the sha256 of bytes ``start``..``end`` once done."""

    file: str
    index: int
    start: int
    end: int
    status: str
    sha256: str | None


# The event a run with a quantized input or output records as it starts: its data is the plan's formats report
# (resumerge.merge.plan.roles.formats_report: per input model and for the output, the format and the role counts).
FORMATS_EVENT = "formats"
# The kind of event a run records at each start: what became of every input tensor (resumerge.merge.plan.accounting).
INPUTS_EVENT = "inputs"
# The events of a run's phases (resumerge.merge.engine.phasing): its plan's phases, recorded with the plan before any
# starts (data: {"phases": [{"name", "key"}, ...]}), and where the run is, at each phase's start and after each step
# it made durable (data: {"index", "of", "name", "done", "total", "unit"}; the last phase, the merge, no counts:
# its shards, tensors and bytes are the run's own).
PHASES_EVENT = "phases"
PHASE_EVENT = "phase"


@dataclass(frozen=True)
class EventRow:
    """One event of a ledger's append-only log; ``data`` is the JSON text (the merge ledger only)."""

    kind: str
    message: str
    data: str | None = None


@dataclass(frozen=True)
class MergeRecord:
    """A merge ledger's run and planned files, in write order (what ``verify`` and a recipe's stage check read)."""

    run: RunRow
    files: tuple[FileRow, ...]

    @property
    def files_done(self) -> int:
        """How many planned files are committed."""
        return sum(1 for f in self.files if f.status == "done")


@dataclass(frozen=True)
class MergeStatusRows:
    """What ``status`` shows of a merge ledger: its record, tensor counts and the latest events of each kind."""

    record: MergeRecord
    tensors_total: int
    tensors_done: int
    events: tuple[EventRow, ...]  # the latest 8, oldest first
    memory: EventRow | None  # the latest ``memory`` event of host RAM (its data holds the budget), not a GPU's
    adaptations: tuple[EventRow, ...]  # the latest 3 ``adaptation`` events, oldest first
    stream: EventRow | None  # the latest ``stream`` event (hub inputs read by HTTP Range)
    plan_notes: tuple[str, ...]  # every distinct ``plan`` message, first seen first
    nodes: tuple[NodeTally, ...] = ()  # a cluster run's shards per node (:mod:`resumerge.merge.store.nodestats`)
    formats: EventRow | None = None  # the latest FORMATS_EVENT: the plan's formats report (quantized runs only)
    inputs: EventRow | None = None  # the latest INPUTS_EVENT: what became of every input tensor
    units: tuple[UnitRow, ...] = ()  # the units of the files written in place (a GGUF output's)
    phase: EventRow | None = None  # the latest PHASE_EVENT: where a run of several phases is


@contextmanager
def reading(path: Path, what: str) -> Iterator[sqlite3.Connection]:
    """A read-only connection (rows as :class:`sqlite3.Row`) to the SQLite file at ``path``; SQLite failures and
    bad JSON columns inside the block raise :class:`LedgerError` naming it as ``what``."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        yield conn
    except (sqlite3.DatabaseError, ValueError, TypeError) as exc:  # ValueError, TypeError: a JSON column is bad
        raise LedgerError(f"the {what} {path} is unreadable ({exc})", path=str(path)) from None
    finally:
        conn.close()


def run_row(conn: sqlite3.Connection) -> RunRow | None:
    """The ``run`` row of the merge ledger open on ``conn`` (any row factory), or None for a fresh ledger; the
    writer (:meth:`resumerge.merge.store.ledger.Ledger.run_row`) reads it through here too."""
    row = conn.execute("SELECT fingerprint, parts, inputs, state, last_error, peak_rss, adaptations, created_at, "
                       "updated_at, config_text, options, model_dirs FROM run WHERE id = 1").fetchone()
    if row is None:
        return None
    fingerprint, parts, inputs, state, error, peak, adaptations, created, updated, text, options, dirs = row
    # A ledger read before the writer migrated it (status of a run of the previous version) has no kind column.
    columns = {str(c[1]) for c in conn.execute("PRAGMA table_info(run)").fetchall()}
    kind = conn.execute("SELECT kind FROM run WHERE id = 1").fetchone()[0] if "kind" in columns else None
    return RunRow(str(fingerprint), dict(json.loads(parts)), dict(json.loads(inputs)), str(state), error,
                  int(peak or 0), int(adaptations or 0), created, updated, str(text or ""), dict(json.loads(options)),
                  dict(json.loads(dirs)), str(kind) if kind else None)


def file_rows(conn: sqlite3.Connection) -> tuple[FileRow, ...]:
    """Every planned output file of the merge ledger open on ``conn`` (any row factory), in write order."""
    rows = conn.execute("SELECT name, kind, status, bytes, planned_bytes, sha256 FROM files ORDER BY position")
    return tuple(FileRow(*r) for r in rows)


def unit_rows(conn: sqlite3.Connection, name: str | None = None) -> tuple[UnitRow, ...]:
    """The units of the files written in place in the merge ledger open on ``conn`` (of file ``name`` only, when
    given), in file and index order; none in a ledger made before units were journaled (migration m007)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'units'").fetchone() is None:
        return ()
    where, args = ("WHERE file = ? ", (name,)) if name is not None else ("", ())
    rows = conn.execute(f"SELECT file, idx, start, \"end\", status, sha256 FROM units {where}ORDER BY file, idx", args)
    return tuple(UnitRow(str(r[0]), int(r[1]), int(r[2]), int(r[3]), str(r[4]), r[5]) for r in rows)


def read_unit_rows(path: Path) -> tuple[UnitRow, ...]:
    """The units of the files written in place in the merge ledger at ``path`` (``status`` and ``verify``)."""
    with reading(path, "ledger") as conn:
        return unit_rows(conn)


def read_merge_record(path: Path) -> MergeRecord | None:
    """The run and files of the merge ledger at ``path``; None when it holds no run (a fresh ledger)."""
    with reading(path, "ledger") as conn:
        run = run_row(conn)
        return MergeRecord(run, file_rows(conn)) if run is not None else None


@dataclass(frozen=True)
class ManifestFacts:
    """What OUT's manifest holds of a run, as the run's ledger records it (:mod:`resumerge.merge.store.manifestcheck`
    rebuilds the manifest from these): the record, the version that planned it, each shard's tensor count and
    the plan's tensor count."""

    record: MergeRecord
    version: str
    shard_tensors: dict[str, int]
    tensors_total: int


def read_manifest_facts(path: Path) -> ManifestFacts | None:
    """The :class:`ManifestFacts` of the merge ledger at ``path``; None when it holds no run."""
    with reading(path, "ledger") as conn:
        run = run_row(conn)
        if run is None:
            return None
        version = conn.execute("SELECT version FROM run WHERE id = 1").fetchone()[0]
        counts = conn.execute("SELECT name, tensors FROM files WHERE kind = 'shard'").fetchall()
        total = conn.execute("SELECT COUNT(*) FROM tensors").fetchone()[0]
        return ManifestFacts(MergeRecord(run, file_rows(conn)), str(version),
                             {str(r[0]): int(r[1] or 0) for r in counts}, int(total))


def read_merge_status(path: Path) -> MergeStatusRows | None:
    """What ``status`` shows of the merge ledger at ``path``; None when it holds no run."""
    with reading(path, "ledger") as conn:
        run = run_row(conn)
        if run is None:
            return None
        total, done = conn.execute("SELECT COUNT(*), COALESCE(SUM(status = 'done'), 0) FROM tensors").fetchone()

        def latest(kind: str | None, limit: int) -> tuple[EventRow, ...]:
            where = "" if kind is None else "WHERE kind = ? "
            rows = conn.execute(f"SELECT kind, message, data FROM events {where}ORDER BY id DESC LIMIT {limit}",
                                () if kind is None else (kind,)).fetchall()
            return tuple(EventRow(r["kind"], r["message"], r["data"]) for r in reversed(rows))

        # A GPU's memory events (their data names its pool) follow the host's at a run's start and end.
        memory = tuple(e for e in latest("memory", 4) if '"pool"' not in (e.data or ""))[-1:]
        stream = latest("stream", 1)
        formats, inputs, phase = latest(FORMATS_EVENT, 1), latest(INPUTS_EVENT, 1), latest(PHASE_EVENT, 1)
        notes = conn.execute("SELECT message FROM events WHERE kind = 'plan' GROUP BY message ORDER BY MIN(id)")
        return MergeStatusRows(
            record=MergeRecord(run, file_rows(conn)),
            tensors_total=int(total),
            tensors_done=int(done),
            events=latest(None, 8),
            memory=memory[0] if memory else None,
            adaptations=latest("adaptation", 3),
            stream=stream[0] if stream else None,
            plan_notes=tuple(r[0] for r in notes.fetchall()),
            nodes=node_tallies(conn),
            formats=formats[0] if formats else None,
            inputs=inputs[0] if inputs else None,
            units=unit_rows(conn),
            phase=phase[0] if phase else None,
        )


def tensor_names(path: Path) -> tuple[str, ...]:
    """Every planned tensor's name in the merge ledger at ``path`` (a kind whose status counts its modules or
    layers from its own plan's tensors reads them; a plain merge's status never does: 90k names cost most of a
    status call)."""
    with reading(path, "ledger") as conn:
        return tuple(str(r[0]) for r in conn.execute("SELECT name FROM tensors").fetchall())


def read_formats(path: Path) -> dict[str, Any] | None:
    """The formats report the run of the merge ledger at ``path`` recorded (:data:`FORMATS_EVENT`), or None (no
    ledger, a plain run, or a run recorded before runs recorded it)."""
    if not path.exists():
        return None
    with reading(path, "ledger") as conn:
        row = conn.execute("SELECT data FROM events WHERE kind = ? ORDER BY id DESC LIMIT 1",
                           (FORMATS_EVENT,)).fetchone()
        return dict(json.loads(row[0])) if row is not None and row[0] else None

"""The run ledger of one merge: SQLite (through sqlite-utils) in the local state directory, never in the output
directory. It builds on :class:`resumerge.merge.store.journal.Journal` (connection, pragmas, checks, failure mapping,
set-aside), which it shares with the recipe ledger.

Tables: ``run`` (one row: config text, the kind of run, fingerprint and its parts, options, model directories,
state, peak memory), ``files`` (every planned output file: shards, index, config, tokenizer files; status, bytes,
sha256, seconds), ``tensors`` (every output tensor: shard, status, bytes), ``events`` (an append-only log),
``stream_reads``, ``frozen_plan`` (the plan itself, stored once, for resumes), ``input_contents`` (the sha256
of every local input file, for :mod:`resumerge.inputs.contents`) and ``units`` (the units of a file written in
place, each with the checksum of its bytes once durable: :mod:`resumerge.merge.store.units`). The ``sha256`` columns of
``files`` and ``units`` keep their first name but hold a record naming its algorithm
(:mod:`resumerge.machine.checksums`: a sha256 bare, as every row before issue 87, or ``xxh3-128:HEX``); a run
records with the algorithm its rows already use (:meth:`Ledger.records_checksum`). The first schema's
``tensors.crc32`` and ``tensors.seconds`` were never filled (a per-tensor checksum cost the writer thread as much
time as the shard's sha256, and nothing read either); migration m003 drops them. Every state change is one
transaction; WAL with ``synchronous=FULL`` so a committed row survives power loss. The read-only view for
``status`` and ``verify`` is :mod:`resumerge.merge.store.ledger_read` (standard library only).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.machine.checksums import Checksum, checksum_of
from resumerge.merge.store.journal import Journal
from resumerge.merge.store.journal import set_aside as set_aside
from resumerge.merge.store.journal import sqlite_failure as sqlite_failure
from resumerge.merge.store.ledger_read import LEDGER_NAME as LEDGER_NAME
from resumerge.merge.store.ledger_read import FileRow, RunRow, UnitRow, file_rows, run_row, unit_rows
from resumerge.merge.store.sqlitedb import Database, Migrations

if TYPE_CHECKING:
    from resumerge.merge.store.manifest import Manifest

migrations = Migrations("resumerge")


@migrations()
def m001_initial(db: Database) -> None:
    """The first schema."""
    db.table("run").create(
        {
            "id": int,
            "out_dir": str,
            "config_text": str,
            "fingerprint": str,
            "parts": str,
            "inputs": str,
            "options": str,
            "model_dirs": str,
            "state": str,
            "version": str,
            "created_at": float,
            "updated_at": float,
            "peak_rss": int,
            "adaptations": int,
            "last_error": str,
        },
        pk="id",
    )
    db.table("files").create(
        {
            "name": str,
            "kind": str,
            "position": int,
            "planned_bytes": int,
            "status": str,
            "bytes": int,
            "sha256": str,
            "tensors": int,
            "seconds": float,
            "committed_at": float,
        },
        pk="name",
    )
    db.table("tensors").create(
        {
            "name": str,
            "shard": str,
            "status": str,
            "bytes": int,
            "crc32": int,
            "seconds": float,
        },
        pk="name",
    )
    db.table("tensors").create_index(["shard"])
    db.table("events").create({"id": int, "at": float, "kind": str, "message": str, "data": str}, pk="id")


@migrations()
def m002_stream_reads(db: Database) -> None:
    """The sha256 of every input byte range read by HTTP Range, first read wins (issue 15): a re-read after a
    resume must give the same bytes."""
    db.table("stream_reads").create(
        {"model": str, "file": str, "start": int, "end": int, "sha256": str}, pk=("model", "file", "start", "end")
    )


@migrations()
def m003_drop_unfilled_tensor_columns(db: Database) -> None:
    """Drop ``tensors.crc32`` and ``tensors.seconds``: nothing fills them any more, and nothing ever read them."""
    db.table("tensors").transform(drop={"crc32", "seconds"})


@migrations()
def m004_frozen_plan(db: Database) -> None:
    """The frozen plan of the run, stored once when the run is recorded (issue 45), so that a resume reloads it
    rather than planning again: ``key`` says what it stays valid for, ``data`` is the plan's compressed bytes."""
    db.table("frozen_plan").create({"id": int, "key": str, "data": bytes}, pk="id")


@migrations()
def m005_run_kind(db: Database) -> None:
    """The kind of run recorded (``merge``, ``moe``, ``extraction``: the API's kinds table names them), written
    once with the run, so that ``resume`` and ``status`` ask that kind; a run recorded before has none (the API
    derives it from the recorded text, in one place)."""
    db.table("run").add_column("kind", str)


@migrations()
def m006_input_contents(db: Database) -> None:
    """The full sha256 of every local input weight file, with its size, mtime and ctime when hashed, recorded when
    the run starts (issue 60): a resume proves a file that looks different holds the same bytes, or refuses."""
    db.table("input_contents").create(
        {"path": str, "size": int, "mtime_ns": int, "ctime_ns": int, "sha256": str}, pk="path"
    )


@migrations()
def m007_units(db: Database) -> None:
    """The units of files written in place (a GGUF output: its header, then groups of tensors; issue 71), each
    ``done`` with the sha256 of its byte range once durable, so that an interrupted run keeps the units it wrote;
    ``tensors`` the JSON list of its output tensors, done and pending with it."""
    db.table("units").create(
        {"file": str, "idx": int, "start": int, "end": int, "status": str, "sha256": str, "tensors": str},
        pk=("file", "idx"),
    )


@migrations()
def m008_sqlite_version(db: Database) -> None:
    """The SQLite library version that recorded the run (``sqlite3.sqlite_version``; issue 97): SQLite before
    3.51.3 can corrupt a WAL two connections write at once, so a damaged ledger says which SQLite wrote it."""
    db.table("run").add_column("sqlite_version", str)


class Ledger(Journal):
    """Write access to one output directory's ledger. Thread-safe: one lock guards the connection.

    Opening raises :class:`LedgerError` when the file is not a SQLite database, fails SQLite's ``quick_check`` or
    has another schema (the session then sets it aside with :func:`set_aside` and rebuilds from OUT's manifest),
    and :class:`StorageError` when the state dir cannot be written (full, read-only, I/O error).
    """

    migrations = migrations

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        # Run before every commit; raising refuses it (the session checks that no input changed mid-run).
        self.commit_guard: Callable[[], None] | None = None

    # -- run ---------------------------------------------------------------------------------------------
    def run_row(self) -> RunRow | None:
        """The run's row (the read side's type and query), or None for a fresh ledger."""
        with self._transaction():
            return run_row(self.db.conn)

    def start_run(
        self,
        out_dir: str,
        kind: str,
        plan: Manifest,
        *,
        files: Iterable[tuple[str, str, int, int, int | None]],
        tensors: Iterable[tuple[str, str, int]],
        frozen: tuple[str, bytes] | None = None,
        units: Iterable[tuple[str, int, int, int, tuple[str, ...]]] = (),
    ) -> None:
        """Record a new plan in one transaction, replacing any earlier run: a run of ``kind`` into ``out_dir``, the
        plan as OUT's manifest records it (``plan``: its version, fingerprint and parts, inputs, options, model
        folders and config text; its files' fields are not read here), and ``files`` are
        (name, kind, position, tensor count, planned bytes or None); ``tensors`` are (name, shard, bytes); ``frozen``
        the plan itself as (key, bytes) for :meth:`frozen_plan`, when it can be stored; ``units`` (file, index,
        start, end, tensors) the units of the files written in place."""
        now = time.time()
        with self._transaction():
            for table in ("run", "files", "tensors", "frozen_plan", "input_contents", "units"):
                self.db.execute(f"DELETE FROM [{table}]")
            self._insert(
                "run",
                {
                    "id": 1,
                    "out_dir": out_dir,
                    "config_text": plan.config_text,
                    "kind": kind,
                    "fingerprint": plan.fingerprint,
                    "parts": json.dumps(dict(plan.parts), sort_keys=True),
                    "inputs": json.dumps(dict(plan.inputs), sort_keys=True),
                    "options": json.dumps(dict(plan.options), sort_keys=True),
                    "model_dirs": json.dumps(dict(plan.model_dirs), sort_keys=True),
                    "state": "planned",
                    "version": plan.version,
                    "sqlite_version": sqlite3.sqlite_version,
                    "created_at": now,
                    "updated_at": now,
                    "peak_rss": 0,
                    "adaptations": 0,
                    "last_error": None,
                }
            )
            self.db.conn.executemany("INSERT INTO files (name, kind, position, planned_bytes, status, tensors) VALUES "
                                     "(?, ?, ?, ?, 'pending', ?)", ((n, k, p, b, c) for n, k, p, c, b in files))
            self.db.conn.executemany("INSERT INTO tensors (name, shard, status, bytes) VALUES (?, ?, 'pending', ?)",
                                tensors)
            self.db.conn.executemany("INSERT INTO units (file, idx, start, \"end\", status, tensors) VALUES "
                                     "(?, ?, ?, ?, 'pending', ?)",
                                     ((f, i, a, b, json.dumps(list(t))) for f, i, a, b, t in units))
            if frozen is not None:
                self.db.execute("INSERT INTO frozen_plan (id, key, data) VALUES (1, ?, ?)", frozen)
            count = self.db.execute("SELECT count(*) FROM files").fetchone()[0]
            self._event("planned", f"planned {count} files")

    def frozen_plan(self) -> tuple[str, bytes] | None:
        """The (key, bytes) of the plan :meth:`start_run` stored, or None when it stored none."""
        with self._transaction():
            row = self.db.execute("SELECT key, data FROM frozen_plan WHERE id = 1").fetchone()
        return (str(row[0]), bytes(row[1])) if row is not None else None

    def input_contents(self) -> dict[str, tuple[int, int, int, str]]:
        """(size, mtime_ns, ctime_ns, digest) of each local input file by path, as :meth:`record_input_contents`
        recorded them (empty for a run recorded before they were). The column keeps its first name, ``sha256``: the
        digest is :mod:`resumerge.inputs.contents`' (the ranges the plan reads, or a whole-file sha256 before)."""
        with self._transaction():
            rows = self.db.execute("SELECT path, size, mtime_ns, ctime_ns, sha256 FROM input_contents").fetchall()
        return {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), str(r[4])) for r in rows}

    def record_input_contents(self, contents: Mapping[str, tuple[int, int, int, str]]) -> None:
        """Record (or update) the content of local input files by path, in one transaction."""
        with self._transaction():
            self.db.conn.executemany("INSERT OR REPLACE INTO input_contents VALUES (?, ?, ?, ?, ?)",
                                     ((path, *content) for path, content in sorted(contents.items())))

    def record_peak(self, peak_rss: int, adaptations: int) -> None:
        """Keep the highest peak RSS seen across the run's processes, and count memory adaptations."""
        with self._transaction():
            row = run_row(self.db.conn)
            self._update("run", "id", 1, {"peak_rss": max(peak_rss, row.peak_rss if row else 0),
                                          "adaptations": (row.adaptations if row else 0) + adaptations})

    # -- files and tensors --------------------------------------------------------------------------------
    def files(self) -> tuple[FileRow, ...]:
        """Every planned output file, in write order (the read side's type and query)."""
        with self._transaction():
            return file_rows(self.db.conn)

    def commit_file(
        self,
        name: str,
        *,
        size: int,
        sha256: str,
        seconds: float,
        tensors: Iterable[str] = (),
    ) -> None:
        """Mark ``name`` and its ``tensors`` committed, in one transaction. Call only after the file is durable.

        Raises whatever :attr:`commit_guard` raises, committing nothing.
        """
        if self.commit_guard is not None:
            self.commit_guard()
        now = time.time()
        with self._transaction():
            self._update("files", "name", name,
                         {"status": "done", "bytes": size, "sha256": sha256, "seconds": seconds, "committed_at": now})
            # One statement for the shard's tensors (sqlite-utils' update looks each row up first: 0.1 ms a tensor).
            self.db.conn.executemany("UPDATE tensors SET status = 'done' WHERE name = ?", ((t,) for t in tensors))
            self._update("run", "id", 1, {"updated_at": now})

    def records_checksum(self) -> Checksum | None:
        """The algorithm of the run's committed records (files, then units, in write order), or None when none is
        committed: a run continued, or rebuilt from OUT's manifest, records the rest with it, so that its records
        are of one kind whatever version wrote the first (:mod:`resumerge.machine.checksums`). A record of no known
        kind is passed over (reconcile reopens it)."""
        with self._transaction():
            rows = self.db.execute("SELECT sha256 FROM files WHERE status = 'done' AND sha256 IS NOT NULL "
                                   "ORDER BY position").fetchall()
            rows += self.db.execute("SELECT sha256 FROM units WHERE status = 'done' AND sha256 IS NOT NULL "
                                    "ORDER BY file, idx").fetchall()
        return next((found for (recorded,) in rows if (found := checksum_of(str(recorded))) is not None), None)

    def reopen_file(self, name: str, reason: str) -> None:
        """Mark a committed file pending again (it is missing or damaged) with its tensors, and log why."""
        with self._transaction():
            self._update("files", "name", name, {"status": "pending", "bytes": None, "sha256": None})
            self.db.execute("UPDATE tensors SET status = 'pending' WHERE shard = ?", [name])
            self.db.execute("UPDATE units SET status = 'pending', sha256 = NULL WHERE file = ?", [name])
            self._event("repair", f"{name}: {reason}; it will be rebuilt")

    def units(self, name: str | None = None) -> tuple[UnitRow, ...]:
        """The units of the files written in place (of file ``name`` only, when given), in file and index order."""
        with self._transaction():
            return unit_rows(self.db.conn, name)

    def commit_unit(self, name: str, index: int, sha256: str) -> None:
        """Mark unit ``index`` of file ``name`` written, its bytes hashing to ``sha256``. Call only after they are
        durable. Raises whatever :attr:`commit_guard` raises, committing nothing."""
        if self.commit_guard is not None:
            self.commit_guard()
        with self._transaction():
            self.db.execute("UPDATE units SET status = 'done', sha256 = ? WHERE file = ? AND idx = ?",
                            [sha256, name, index])
            self._mark_unit_tensors(name, [index], "done")
            self._update("run", "id", 1, {"updated_at": time.time()})

    def reopen_units(self, name: str, indices: Iterable[int], reason: str) -> None:
        """Mark units ``indices`` of file ``name`` to be written again (their bytes are not what was recorded), and
        log why."""
        indices = sorted(indices)
        with self._transaction():
            self.db.conn.executemany("UPDATE units SET status = 'pending', sha256 = NULL WHERE file = ? AND idx = ?",
                                     ((name, i) for i in indices))
            self._mark_unit_tensors(name, indices, "pending")
            self._event("repair", f"{name}: {reason}; {len(indices)} unit(s) will be written again")

    def _mark_unit_tensors(self, name: str, indices: Iterable[int], status: str) -> None:
        """Set the output tensors of units ``indices`` of file ``name`` to ``status`` (inside a transaction)."""
        for index in indices:
            row = self.db.execute("SELECT tensors FROM units WHERE file = ? AND idx = ?", [name, index]).fetchone()
            names = json.loads(row[0]) if row is not None and row[0] else []
            self.db.conn.executemany("UPDATE tensors SET status = ? WHERE name = ?", ((status, t) for t in names))

    def remember_read(self, model: str, file: str, start: int, end: int, sha256: str) -> str:
        """Record the sha256 of a streamed input range unless one is recorded; return the recorded one."""
        with self._transaction():
            self.db.execute("INSERT OR IGNORE INTO stream_reads VALUES (?, ?, ?, ?, ?)",
                            [model, file, start, end, sha256])
            row = self.db.execute("SELECT sha256 FROM stream_reads WHERE model = ? AND file = ? AND start = ? "
                                  "AND \"end\" = ?", [model, file, start, end]).fetchone()
        return str(row[0])

    def event(self, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        """Append an event in its own transaction."""
        with self._transaction():
            self._event(kind, message, data)

    def last_event_data(self, kind: str) -> dict[str, Any] | None:
        """The data of the newest ``kind`` event, or None when there is none."""
        with self._transaction():
            rows = list(self.db.query("SELECT data FROM events WHERE kind = ? ORDER BY id DESC LIMIT 1", [kind]))
        return dict(json.loads(rows[0]["data"] or "{}")) if rows else None

    def _event(self, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        self._insert("events", {"at": time.time(), "kind": kind, "message": message,
                                "data": json.dumps(dict(data or {}))})

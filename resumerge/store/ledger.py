"""The run ledger: SQLite (through sqlite-utils) in the local state directory, never in the output directory.

Tables: ``run`` (one row: config text, fingerprint and its parts, options, model directories, state, peak
memory), ``files`` (every planned output file: shards, index, config, tokenizer files; status, bytes, sha256),
``tensors`` (every output tensor: shard, status, bytes, seconds; the ``crc32`` column of the first schema is no
longer filled: a per-tensor checksum cost the writer thread as much time as the shard's sha256, and nothing read
it) and ``events`` (an append-only log).
Every state change is one transaction (``Database.atomic``); WAL with ``synchronous=FULL`` so a committed row
survives power loss. The read-only view for ``status`` lives in :mod:`resumerge.ledger_view` (stdlib only).
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from resumerge.errors import LedgerError, ResumergeError, StorageError
from resumerge.store.durable import durability_disabled

LEDGER_NAME = "ledger.db"
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


# SQLite result codes (low byte of the extended code) that mean "the state dir's disk failed", not "the file is bad":
# SQLITE_PERM, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN.
_STORAGE_CODES = frozenset({3, 8, 10, 13, 14})
_STORAGE_WORDS = ("disk is full", "disk i/o error", "readonly", "read-only", "unable to open")


def sqlite_failure(exc: sqlite3.DatabaseError, path: Path) -> ResumergeError:
    """Classify a SQLite error on the ledger at ``path``.

    Disk full, I/O errors, read-only or unopenable files give :class:`StorageError` (exit 3: fix the disk and
    resume); anything else (not a database, malformed, wrong schema) gives :class:`LedgerError` (exit 4).
    """
    code = getattr(exc, "sqlite_errorcode", None)
    storage = (code & 0xFF) in _STORAGE_CODES if isinstance(code, int) else any(
        w in str(exc).lower() for w in _STORAGE_WORDS)
    if storage:
        limit = _file_size_limit()
        hint = (f"a file size limit of {limit} bytes is set (ulimit -f); raise it, then run resumerge resume OUT"
                if limit is not None else
                "free space or fix the state dir's disk (see --state-dir), then run resumerge resume OUT")
        return StorageError(f"the ledger could not be written ({exc})", path=str(path), hint=hint)
    return LedgerError(f"the ledger {path} is damaged ({exc})", path=str(path),
                       hint="resumerge resume OUT sets it aside and rebuilds it from OUT's manifest")


def _file_size_limit() -> int | None:
    """The process's RLIMIT_FSIZE in bytes, or None when unlimited: SQLite reports EFBIG as a mere I/O error."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


@functools.cache
def _expected_columns() -> dict[str, frozenset[str]]:
    """Every table and column the migrations create (from a scratch in-memory database, so never out of date)."""
    scratch = Database(memory=True)
    migrations.apply(scratch)
    columns = {t.name: frozenset(t.columns_dict) for t in scratch.tables}
    scratch.close()
    return columns


def _check_ledger(db: Database, path: Path) -> None:
    """Raise :class:`LedgerError` when ``db`` fails SQLite's quick_check or lacks a table or column we use."""
    problems = [row[0] for row in db.execute("PRAGMA quick_check").fetchall() if row[0] != "ok"]
    if problems:
        raise LedgerError(f"the ledger {path} is damaged ({problems[0]})", path=str(path))
    tables = {t.name: t for t in db.tables}
    for name, columns in _expected_columns().items():
        missing = columns - set(tables[name].columns_dict) if name in tables else {"(table)"}
        if missing:
            raise LedgerError(f"the ledger {path} has another schema (table {name} lacks {sorted(missing)[0]})",
                              path=str(path))


def set_aside(path: Path) -> Path:
    """Move a damaged ledger and its WAL/shm files to ``<name>.damaged`` names; returns the new ledger path.

    The WAL must go too: SQLite would replay a leftover ``-wal`` file into the fresh ledger created next.
    """
    target = path.with_name(path.name + ".damaged")
    for suffix in ("", "-wal", "-shm", "-journal"):
        source = path.with_name(path.name + suffix)
        if source.exists():
            os.replace(source, target.with_name(target.name + suffix))
    return target


class Ledger:
    """Write access to one output directory's ledger. Thread-safe: one lock guards the connection."""

    def __init__(self, path: Path) -> None:
        """Open (creating if needed) the ledger at ``path`` and check it.

        Raises :class:`LedgerError` when the file is not a SQLite database, fails SQLite's ``quick_check`` or has
        another schema (the session then sets it aside with :func:`set_aside` and rebuilds from OUT's manifest),
        and :class:`StorageError` when the state dir cannot be written (full, read-only, I/O error).
        """
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = None
        try:
            conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            if durability_disabled():  # benchmarks only: no journal on disk, no fsync
                conn.execute("PRAGMA journal_mode=MEMORY")
                conn.execute("PRAGMA synchronous=OFF")
            else:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
            self.db = Database(conn)
            migrations.apply(self.db)
            _check_ledger(self.db, path)
        except (sqlite3.DatabaseError, LedgerError) as exc:
            if conn is not None:
                conn.close()
            raise (exc if isinstance(exc, LedgerError) else sqlite_failure(exc, path)) from None
        self._lock = threading.RLock()
        # Run before every commit; raising refuses it (the session checks that no input changed mid-run).
        self.commit_guard: Callable[[], None] | None = None

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One locked, atomic transaction; SQLite failures become :func:`sqlite_failure` errors."""
        with self._lock:
            try:
                with self.db.atomic():
                    yield
            except sqlite3.DatabaseError as exc:
                raise sqlite_failure(exc, self.path) from None

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self.db.conn.close()

    # -- run ---------------------------------------------------------------------------------------------
    def run_row(self) -> dict[str, Any] | None:
        """The run's row, or None for a fresh ledger."""
        with self._transaction():
            rows = list(self.db.table("run").rows_where("id = 1"))
        return rows[0] if rows else None

    def start_run(
        self,
        *,
        out_dir: str,
        config_text: str,
        fingerprint: str,
        parts: Mapping[str, str],
        inputs: Mapping[str, Any],
        options: Mapping[str, Any],
        model_dirs: Mapping[str, str],
        version: str,
        files: Iterable[tuple[str, str, int, int, int | None]],
        tensors: Iterable[tuple[str, str, int]],
    ) -> None:
        """Record a new plan in one transaction, replacing any earlier run.

        ``files`` are (name, kind, position, tensor count, planned bytes or None); ``tensors`` are
        (name, shard, bytes).
        """
        now = time.time()
        with self._transaction():
            for table in ("run", "files", "tensors"):
                self.db.execute(f"DELETE FROM [{table}]")
            self.db.table("run").insert(
                {
                    "id": 1,
                    "out_dir": out_dir,
                    "config_text": config_text,
                    "fingerprint": fingerprint,
                    "parts": json.dumps(dict(parts), sort_keys=True),
                    "inputs": json.dumps(dict(inputs), sort_keys=True),
                    "options": json.dumps(dict(options), sort_keys=True),
                    "model_dirs": json.dumps(dict(model_dirs), sort_keys=True),
                    "state": "planned",
                    "version": version,
                    "created_at": now,
                    "updated_at": now,
                    "peak_rss": 0,
                    "adaptations": 0,
                    "last_error": None,
                }
            )
            self.db.table("files").insert_all(
                {"name": n, "kind": k, "position": p, "planned_bytes": b, "status": "pending", "bytes": None,
                 "sha256": None, "tensors": c, "seconds": None, "committed_at": None}
                for n, k, p, c, b in files
            )
            self.db.table("tensors").insert_all(
                {"name": n, "shard": s, "status": "pending", "bytes": b, "crc32": None, "seconds": None}
                for n, s, b in tensors
            )
            self._event("planned", f"planned {self.db['files'].count} files")

    def record_peak(self, peak_rss: int, adaptations: int) -> None:
        """Keep the highest peak RSS seen across the run's processes, and count memory adaptations."""
        with self._transaction():
            row = self.run_row() or {}
            self.db.table("run").update(1, {"peak_rss": max(peak_rss, row.get("peak_rss") or 0),
                                            "adaptations": (row.get("adaptations") or 0) + adaptations})

    def set_state(self, state: str, *, error: str | None = None) -> None:
        """Move the run to ``state`` (planned|running|interrupted|failed|done), with the last error if any."""
        with self._transaction():
            update: dict[str, Any] = {"state": state, "updated_at": time.time()}
            if error is not None:
                update["last_error"] = error
            self.db.table("run").update(1, update)
            self._event("state", state + (f": {error}" if error else ""))

    # -- files and tensors --------------------------------------------------------------------------------
    def files(self) -> list[dict[str, Any]]:
        """Every planned output file, in write order."""
        with self._transaction():
            return list(self.db.table("files").rows_where(order_by="position"))

    def commit_file(
        self,
        name: str,
        *,
        size: int,
        sha256: str,
        seconds: float,
        tensors: Iterable[str] = (),
        tensor_seconds: Mapping[str, float] | None = None,
    ) -> None:
        """Mark ``name`` and its ``tensors`` committed, in one transaction. Call only after the file is durable.

        Raises whatever :attr:`commit_guard` raises, committing nothing.
        """
        if self.commit_guard is not None:
            self.commit_guard()
        now = time.time()
        with self._transaction():
            self.db.table("files").update(
                name, {"status": "done", "bytes": size, "sha256": sha256, "seconds": seconds, "committed_at": now}
            )
            for tname in tensors:
                self.db.table("tensors").update(
                    tname, {"status": "done", "seconds": (tensor_seconds or {}).get(tname)}
                )
            self.db.table("run").update(1, {"updated_at": now})

    def reopen_file(self, name: str, reason: str) -> None:
        """Mark a committed file pending again (it is missing or damaged) with its tensors, and log why."""
        with self._transaction():
            self.db.table("files").update(name, {"status": "pending", "bytes": None, "sha256": None})
            self.db.execute("UPDATE tensors SET status = 'pending', crc32 = NULL WHERE shard = ?", [name])
            self._event("repair", f"{name}: {reason}; it will be rebuilt")

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

    def _event(self, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        self.db.table("events").insert(
            {"at": time.time(), "kind": kind, "message": message, "data": json.dumps(dict(data or {}))}
        )

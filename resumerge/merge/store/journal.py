"""The journal base of both ledgers (a merge's :class:`~resumerge.merge.store.ledger.Ledger`, a recipe's
``RecipeLedger`` in the recipes package): one SQLite file in the state dir, written through sqlite-utils.

It owns what the two must do alike: the connection and its pragmas (WAL with ``synchronous=FULL``, so a committed
row survives power loss), the migrations, the checks on open (SQLite's ``quick_check`` and every table and column
the migrations create), the mapping of SQLite failures to :class:`StorageError` (the state dir's disk failed: exit
3, fix it and resume) or :class:`LedgerError` (the file is bad: exit 4), one locked transaction per change, and
moving a damaged file aside, and one writing connection per journal file in a process (:func:`_hold_writer`).
May import the standard library, sqlite-utils, ``resumerge.errors`` and
``resumerge.machine.durable``; the read-only side is :mod:`resumerge.merge.store.ledger_read` (standard library
only). The SQLite companion files a journal may have beside it (:data:`COMPANIONS`) are named here only.
"""

from __future__ import annotations

import datetime
import functools
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from resumerge.errors import LedgerError, ResumergeError, StorageError
from resumerge.machine.durable import durability_disabled
from resumerge.merge.store.sqlitedb import Database, Migrations, NotFoundError

# SQLite result codes (low byte of the extended code) that mean "the state dir's disk failed", not "the file is bad":
# SQLITE_PERM, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN.
_STORAGE_CODES = frozenset({3, 8, 10, 13, 14})
_STORAGE_WORDS = ("disk is full", "disk i/o error", "readonly", "read-only", "unable to open")
# What SQLite keeps beside a database file: the WAL and its index, and a rollback journal.
COMPANIONS = ("-wal", "-shm", "-journal")


def journal_files(name: str) -> tuple[str, ...]:
    """The file ``name`` of a journal and its SQLite companions' names: what must move or go with it."""
    return (name, *(name + suffix for suffix in COMPANIONS))


def sqlite_failure(exc: sqlite3.DatabaseError, path: Path, what: str = "ledger",
                   rebuilt_from: str = "OUT's manifest") -> ResumergeError:
    """Classify a SQLite error on the journal at ``path`` (``what`` names it in the message, ``rebuilt_from`` in
    the hint: what a resume rebuilds it from).

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
        return StorageError(f"the {what} could not be written ({exc})", path=str(path), hint=hint)
    return LedgerError(f"the {what} {path} is damaged ({exc})", path=str(path),
                       hint=f"resumerge resume OUT sets it aside and rebuilds it from {rebuilt_from}")


def _file_size_limit() -> int | None:
    """The process's RLIMIT_FSIZE in bytes, or None when unlimited: SQLite reports EFBIG as a mere I/O error."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def set_aside(path: Path, suffix: str = ".damaged") -> Path:
    """Move a damaged (or stale) journal and its WAL/shm files to ``<name><suffix>`` names; returns the new path.

    The WAL must go too: SQLite would replay a leftover ``-wal`` file into the fresh journal created next.
    """
    target = path.with_name(path.name + suffix)
    for name, moved in zip(journal_files(path.name), journal_files(target.name), strict=True):
        source = path.with_name(name)
        if source.exists():
            os.replace(source, path.with_name(moved))
    return target


@dataclass(frozen=True)
class _Schema:
    """What ``migrations`` build, read from a scratch in-memory database they were applied to (never out of date):
    every table's columns, the SQL SQLite keeps for each table and index (tables first, each group in the order
    made), and the names of the migrations, in the order applied."""

    columns: Mapping[str, frozenset[str]]
    statements: tuple[str, ...]
    applied: tuple[str, ...]


@functools.cache
def _schema(migrations: Migrations) -> _Schema:
    scratch = Database(memory=True)
    migrations.apply(scratch)
    columns = {t.name: frozenset(t.columns_dict) for t in scratch.tables}
    rows = scratch.execute("SELECT type, sql FROM sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite%' "
                           "ORDER BY rowid").fetchall()
    statements = tuple(str(sql) for kind, sql in sorted(rows, key=lambda row: row[0] != "table"))
    applied = tuple(m.name for m in migrations.applied(scratch))
    scratch.close()
    return _Schema(columns, statements, applied)


def _build(db: Database, migrations: Migrations) -> None:
    """Bring the journal ``db`` up to date with ``migrations`` (inside the caller's transaction). A fresh file (no
    table yet) gets the whole schema as the migrations build it (:func:`_schema`'s statements) and a record of each
    migration, as sqlite-utils writes it when it applies one: the same tables, columns and indexes, without running
    each migration again (each file's m003 copied its ``tensors`` table through sqlite-utils' schema parser)."""
    if db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
        migrations.apply(db)
        return
    schema = _schema(migrations)
    for sql in schema.statements:
        db.execute(sql)
    now = str(datetime.datetime.now(datetime.timezone.utc))
    db.conn.executemany(f"INSERT INTO [{migrations.migrations_table}] (migration_set, name, applied_at) "
                        "VALUES (?, ?, ?)", ((migrations.name, name, now) for name in schema.applied))


_J = TypeVar("_J", bound="Journal")

# The journal open for writing at each real path in this process. SQLite before 3.51.3 can corrupt a WAL that two
# connections write or checkpoint at once (its WAL-reset bug), so a journal has one writing connection, and a second
# one in the same process is a bug of ours, refused loudly. Other processes are kept out by OUT's run lock.
_WRITERS: dict[str, weakref.ref[Journal]] = {}
_WRITERS_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_WRITERS.clear)  # a forked child holds none of its parent's connections


def _hold_writer(journal: Journal) -> str:
    """Register ``journal`` as its file's one writer in this process (the key, to release it by); raises
    :class:`ResumergeError` (an internal error: a bug) where another open journal of this process writes it."""
    key = os.path.realpath(journal.path)
    with _WRITERS_LOCK:
        held = _WRITERS.get(key)
        other = held() if held is not None else None
        if other is not None and other is not journal:
            raise ResumergeError(f"a second writer of the {journal.what} {journal.path} in one process: SQLite "
                                 "before 3.51.3 can corrupt a WAL two connections write at once",
                                 hint="this is a bug in resumerge: please report it")
        _WRITERS[key] = weakref.ref(journal)
    return key


def _release_writer(key: str, journal: Journal) -> None:
    with _WRITERS_LOCK:
        held = _WRITERS.get(key)
        if held is not None and held() in (journal, None):
            del _WRITERS[key]


class Journal:
    """Write access to one SQLite journal. Thread-safe: one lock guards the connection.

    A subclass names its :attr:`migrations` (the schema, never edited once released: a change is a new
    migration), :attr:`what` (how messages name it), its :attr:`state_table` (whose one row, id 1, holds the
    state of what it journals) and how it appends an event (:meth:`_event`).
    """

    migrations: ClassVar[Migrations]
    what: ClassVar[str] = "ledger"
    rebuilt_from: ClassVar[str] = "OUT's manifest"
    state_table: ClassVar[str] = "run"

    def __init__(self, path: Path) -> None:
        """Open (creating if needed) the journal at ``path``, bring its schema up to date and check it.

        Raises :class:`LedgerError` when the file is not a SQLite database, fails SQLite's ``quick_check`` or
        lacks a table or column the migrations create (:func:`set_aside` then moves it out of the way), and
        :class:`StorageError` when the state dir cannot be written (full, read-only, I/O error).
        """
        self.path = path
        self._writer = _hold_writer(self)
        conn = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            if durability_disabled():  # benchmarks only: no journal on disk, no fsync
                conn.execute("PRAGMA journal_mode=MEMORY")
                conn.execute("PRAGMA synchronous=OFF")
            else:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
            self.db = Database(conn)
            with self.db.atomic():  # the pending migrations in one transaction: one WAL commit, not one each
                _build(self.db, self.migrations)
            self._check()
        except OSError as exc:
            if conn is not None:
                conn.close()
            _release_writer(self._writer, self)
            raise StorageError(f"cannot create {path}: {exc.strerror or exc}", path=str(path),
                               hint="use a writable local state dir (--state-dir DIR or RESUMERGE_STATE_DIR)"
                               ) from None
        except (sqlite3.DatabaseError, LedgerError) as exc:
            if conn is not None:
                conn.close()
            _release_writer(self._writer, self)
            failure = exc if isinstance(exc, LedgerError) else sqlite_failure(exc, path, self.what, self.rebuilt_from)
            raise failure from None
        self._lock = threading.RLock()

    @classmethod
    def open_setting_aside(cls: type[_J], path: Path) -> tuple[_J, str | None]:
        """Open the journal at ``path``; a damaged one is never trusted: it is moved aside (``<name>.damaged``)
        and a fresh one opened. Returns the journal and, when one was set aside, a note saying so.

        Only for a journal whose whole content can be rebuilt (the caller rebuilds it); raises
        :class:`StorageError` when the state dir refuses the move.
        """
        try:
            return cls(path), None
        except LedgerError as exc:
            try:
                aside = set_aside(path)
            except OSError as failure:
                raise StorageError(f"the {cls.what} is damaged and cannot be moved aside ({failure.strerror})",
                                   path=str(path), hint="make the state dir writable, then run resumerge resume OUT"
                                   ) from None
            return cls(path), f"{exc.message}: set aside as {aside.name}, nothing in it is trusted"

    def _check(self) -> None:
        """Raise :class:`LedgerError` when the file fails SQLite's quick_check or lacks a table or column we use."""
        problems = [row[0] for row in self.db.execute("PRAGMA quick_check").fetchall() if row[0] != "ok"]
        if problems:
            raise LedgerError(f"the {self.what} {self.path} is damaged ({problems[0]})", path=str(self.path))
        tables: dict[str, set[str]] = {}
        for table, column in self.db.execute("SELECT m.name, p.name FROM sqlite_master AS m "
                                             "JOIN pragma_table_info(m.name) AS p WHERE m.type = 'table'"):
            tables.setdefault(table, set()).add(column)
        for name, columns in _schema(self.migrations).columns.items():
            missing = columns - tables[name] if name in tables else {"(table)"}
            if missing:
                raise LedgerError(f"the {self.what} {self.path} has another schema (table {name} lacks "
                                  f"{sorted(missing)[0]})", path=str(self.path))

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One locked, atomic transaction; SQLite failures become :func:`sqlite_failure` errors."""
        with self._lock:
            try:
                with self.db.atomic():
                    yield
            except sqlite3.DatabaseError as exc:
                raise sqlite_failure(exc, self.path, self.what, self.rebuilt_from) from None

    def set_state(self, state: str, *, error: str | None = None) -> None:
        """Move what the journal records to ``state`` (planned, running, interrupted, failed, done), with the last
        error if any."""
        with self._transaction():
            update: dict[str, Any] = {"state": state, "updated_at": time.time()}
            if error is not None:
                update["last_error"] = error
            self._update(self.state_table, "id", 1, update)
            self._event("state", state + (f": {error}" if error else ""))

    def _update(self, table: str, key: str, value: object, values: Mapping[str, object]) -> None:
        """Set ``values`` in the row of ``table`` whose ``key`` is ``value`` (inside the caller's transaction): one
        UPDATE where sqlite-utils' ``Table.update`` issued seven (its row lookup, schema reads, a savepoint).
        Raises sqlite-utils' ``NotFoundError`` where no row has that key, as that did."""
        sets = ", ".join(f"[{column}] = ?" for column in values)
        if self.db.execute(f"UPDATE [{table}] SET {sets} WHERE [{key}] = ?", [*values.values(), value]).rowcount != 1:
            raise NotFoundError

    def _insert(self, table: str, row: Mapping[str, object]) -> None:
        """Insert ``row`` into ``table`` (inside the caller's transaction): one INSERT where sqlite-utils'
        ``Table.insert`` read the schema first."""
        self.db.execute(f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in row)}) "
                        f"VALUES ({', '.join('?' * len(row))})", list(row.values()))

    def _event(self, kind: str, message: str) -> None:
        """Append an event (each journal writes its own columns)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the connection: the journal's file may have another writer now."""
        with self._lock:
            self.db.conn.close()
            _release_writer(self._writer, self)

"""The fixed cost of one tiny ``resumerge.api.run``: what depends only on the installation is read once per
process, not at every run (bench/bench_tiny_run.py measures the CPU a tiny run takes)."""

from __future__ import annotations

import importlib.metadata
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import linear_config

from resumerge import api


def _run(tmp_path: Path, name: str, doc: dict[str, object]) -> Path:
    out = tmp_path / name / "out"
    api.run(yaml.safe_dump(doc, sort_keys=False), out, settings=api.Settings(state_dir=tmp_path / name / "state"))
    return out


@pytest.fixture
def ran_once(tmp_path: Path, make: Any) -> dict[str, object]:
    """A tiny linear merge's config, merged once in this process (what is made once a process is made)."""
    doc = linear_config(make("a", seed=1), make("b", seed=2))
    _run(tmp_path, "first", doc)
    return doc


def test_a_second_run_in_the_process_reads_no_distribution_metadata(
    tmp_path: Path, ran_once: dict[str, object], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # before: the memory baseline's key read torch's and transformers' versions (importlib.metadata) at each run
    doc = ran_once
    reads: list[str] = []
    version = importlib.metadata.version

    def counted(name: str) -> str:
        reads.append(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", counted)
    _run(tmp_path, "second", doc)
    assert reads == []


def test_a_run_parses_its_config_text_once(tmp_path: Path, make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # before: five parses of one text per run (its kind twice, the check, the plan, the model card)
    a, b = make("a", seed=1), make("b", seed=2)
    _run(tmp_path, "first", linear_config(a, b))
    loads: list[str] = []
    load_all = yaml.load_all

    def counted(stream: Any, Loader: Any = None) -> Any:
        loads.append(str(stream))
        return load_all(stream, Loader)

    monkeypatch.setattr(yaml, "load_all", counted)
    doc = linear_config(a, b, weights=(0.25, 0.75))  # a text not parsed before in this process
    _run(tmp_path, "second", doc)
    assert len(loads) == 1, len(loads)


def test_a_fresh_ledger_builds_its_schema_in_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # before: one transaction (one WAL commit, fsynced under synchronous=FULL) per migration, nine for a fresh ledger
    from resumerge.merge.store.ledger import Ledger
    from resumerge.merge.store.ledger_read import run_row

    Ledger(tmp_path / "warm.db").close()  # the schema's expected columns, kept per process, built first
    statements = _traced(monkeypatch)
    ledger = Ledger(tmp_path / "ledger.db")
    try:
        assert [s for s in statements if s.strip().upper() == "COMMIT"] == ["COMMIT"]
        assert [m.name for m in Ledger.migrations.pending(ledger.db)] == []
        assert run_row(ledger.db.conn) is None
    finally:
        ledger.close()
    again = Ledger(tmp_path / "ledger.db")  # reopened: nothing left to migrate, the schema checks
    again.close()


def _traced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements every SQLite connection opened from now on issues (nested ones, ``-- …``, too)."""
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn: sqlite3.Connection = connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    return statements


def test_a_run_reads_no_ledger_schema_to_write_its_rows(
    tmp_path: Path, ran_once: dict[str, object], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # before: ~600 statements a tiny run, most of them sqlite-utils' reading the schema again at each call (the view
    # and table lists, PRAGMA table_info twice and the row itself before each UPDATE, a savepoint around it), and a
    # fresh ledger's nine migrations run one by one (m003 copying its tensors table through sqlite-utils' parser)
    doc = ran_once
    statements = _traced(monkeypatch)
    out = _run(tmp_path, "second", doc)
    assert (out / "resumerge-manifest.json").is_file()
    # (sqlite-utils quotes the names it reads the schema of; the read side's own PRAGMA table_info(run) stays)
    introspection = [s for s in statements if s.startswith(('PRAGMA table_info("', "SAVEPOINT", "select name from "
                                                            "sqlite_master where type = 'view'"))]
    assert introspection == [], introspection[:5]
    assert not [s for s in statements if "tensors_new_" in s]  # m003's copy of the tensors table
    assert len(statements) < 300, len(statements)


@pytest.mark.parametrize("kind", ["ledger", "recipe"])
def test_a_fresh_journal_has_the_schema_its_migrations_build(tmp_path: Path, kind: str) -> None:
    # a fresh journal gets the schema its migrations build (their SQL, kept from a scratch database) without running
    # them: the same tables, columns, indexes and SQL, and a record of each migration, so a reopen applies none
    from resumerge.merge.store.ledger import Ledger
    from resumerge.merge.store.sqlitedb import Database
    from resumerge.runs.recipes.ledger import RecipeLedger

    cls = Ledger if kind == "ledger" else RecipeLedger
    migrated = Database(tmp_path / "migrated.db")
    cls.migrations.apply(migrated)
    journal = cls(tmp_path / "fresh.db")
    schema = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
    names = "SELECT migration_set, name FROM _sqlite_migrations ORDER BY id"
    try:
        assert journal.db.execute(schema).fetchall() == migrated.execute(schema).fetchall()
        assert journal.db.execute(names).fetchall() == migrated.execute(names).fetchall()
        columns = "SELECT m.name, p.* FROM sqlite_master AS m JOIN pragma_table_info(m.name) AS p ORDER BY 1, 2"
        assert journal.db.execute(columns).fetchall() == migrated.execute(columns).fetchall()
    finally:
        journal.close()
        migrated.close()
    again = cls(tmp_path / "fresh.db")
    try:
        assert cls.migrations.pending(again.db) == []
    finally:
        again.close()


def test_a_commit_of_a_file_the_ledger_never_planned_is_refused(tmp_path: Path) -> None:
    # the ledger's own UPDATE (one statement) refuses a row that is not there, as sqlite-utils' Table.update did
    from resumerge.merge.store.ledger import Ledger
    from resumerge.merge.store.sqlitedb import NotFoundError

    ledger = Ledger(tmp_path / "ledger.db")
    try:
        with pytest.raises(NotFoundError):
            ledger.commit_file("model-00009-of-00009.safetensors", size=1, sha256="0" * 64, seconds=0.0)
        with pytest.raises(NotFoundError):
            ledger.set_state("running")  # no run recorded
    finally:
        ledger.close()

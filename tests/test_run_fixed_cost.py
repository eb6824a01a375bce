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


def test_a_second_run_in_the_process_reads_no_distribution_metadata(
    tmp_path: Path, make: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # before: the memory baseline's key read torch's and transformers' versions (importlib.metadata) at each run
    doc = linear_config(make("a", seed=1), make("b", seed=2))
    _run(tmp_path, "first", doc)
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
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn: sqlite3.Connection = connect(*args, **kwargs)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    ledger = Ledger(tmp_path / "ledger.db")
    try:
        assert [s for s in statements if s.strip().upper() == "COMMIT"] == ["COMMIT"]
        assert [m.name for m in Ledger.migrations.pending(ledger.db)] == []
        assert run_row(ledger.db.conn) is None
    finally:
        ledger.close()
    again = Ledger(tmp_path / "ledger.db")  # reopened: nothing left to migrate, the schema checks
    again.close()

"""One writing connection per journal (issue 97, item 10): SQLite before 3.51.3 can corrupt a WAL two connections
write or checkpoint at once, so a second writer of one ledger in a process is refused loudly, and the run records
the SQLite that wrote it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from support import linear_config, write_config

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.locations import LEDGER_NAME, run_dir
from resumerge.errors import EXIT_INTERNAL, ResumergeError, exit_code_for
from resumerge.merge.store.ledger import Ledger
from resumerge.runs.recipes.ledger import RecipeLedger


@pytest.mark.parametrize("journal", [Ledger, RecipeLedger])
def test_a_second_writer_of_one_journal_is_refused_loudly(journal: type[Ledger | RecipeLedger],
                                                          tmp_path: Path) -> None:
    path = tmp_path / "state" / "ledger.db"
    first = journal(path)
    with pytest.raises(ResumergeError, match="second writer") as refused:
        journal(tmp_path / "state" / ".." / "state" / "ledger.db")  # the same file by another spelling
    assert exit_code_for(refused.value) == EXIT_INTERNAL
    other = journal(tmp_path / "other.db")  # another journal: its own writer
    other.close()
    first.close()
    journal(path).close()  # the first one closed: the file may be written again


def test_the_run_records_the_sqlite_that_wrote_its_ledger(tmp_path: Path) -> None:
    spec = ModelSpec(layers=1, hidden=32, intermediate=48, vocab=64)
    a, b = make_model(tmp_path / "a", spec, seed=1), make_model(tmp_path / "b", spec, seed=2)
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["run", str(write_config(tmp_path / "c.yml", linear_config(a, b))), str(out), "--state-dir",
                 str(state), "--quiet"]) == 0
    with sqlite3.connect(run_dir(out, state) / LEDGER_NAME) as db:
        assert db.execute("SELECT sqlite_version FROM run").fetchone() == (sqlite3.sqlite_version,)

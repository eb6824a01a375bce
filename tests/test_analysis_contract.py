"""Every analysis of the one table (:data:`resumerge.config.analyses.ANALYSES`, made by
:func:`resumerge.api.analyses.analyses`) keeps the :class:`~resumerge.api.analyses.Analysis` contract (one row per
analysis), and the API walks the table with no special case: a test-only analysis plugged in by one row is what
``status`` answers for its folder."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from resumerge import api
from resumerge.api import analyses as table
from resumerge.config import analyses as rows
from resumerge.config.analyses import AnalysisRow
from resumerge.config.locations import StateDir
from resumerge.config.passplace import named
from resumerge.errors import NothingRecordedError
from resumerge.merge.store.statusview import StatusReport


@pytest.mark.parametrize("row", [row for row in rows.ANALYSES if row.analysis], ids=lambda row: row.name)
def test_each_analysis_keeps_the_contract(row: AnalysisRow, tmp_path: Path) -> None:
    analysis: table.Analysis = named(row.analysis)()
    state = StateDir.resolve(tmp_path / "state")
    for method in ("holds", "status", "journal"):
        assert callable(getattr(analysis, method)), method
        assert list(inspect.signature(getattr(analysis, method)).parameters)[-1] == "state", method
    assert not analysis.holds(tmp_path, state)  # an empty folder is no analysis's
    assert not analysis.holds("hf://org/name", state)
    journal = analysis.journal(state)
    assert journal.parent == state.root and journal.name  # a folder of its own under the state dir
    assert [r.name for r in rows.ANALYSES].count(row.name) == 1


class _Toy:
    """A test-only analysis: a folder holding ``toy.json`` is its own."""

    def holds(self, out: object, state: StateDir) -> bool:
        return (Path(str(out)) / "toy.json").is_file()

    def status(self, out: object, state: StateDir) -> StatusReport:
        return StatusReport(out_dir=str(out), state="done", source="toy", tensors_total=1, tensors_done=1,
                            shards_total=1, shards_done=1, bytes_total=0, bytes_done=0, resume_command=None,
                            kind="toy")

    def journal(self, state: StateDir) -> Path:
        return state.root / "toys"


def test_a_new_analysis_is_one_row_of_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "toy"
    folder.mkdir()
    with pytest.raises(NothingRecordedError):
        api.status(folder)
    (folder / "toy.json").write_text(json.dumps({}))
    toy = AnalysisRow("toy", "toy_command:run", f"{__name__}:_Toy", ())
    monkeypatch.setattr(rows, "ANALYSES", (*rows.ANALYSES, toy))
    shown = api.status(folder)
    assert isinstance(shown, StatusReport) and (shown.kind, shown.state) == ("toy", "done")

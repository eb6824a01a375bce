"""A new analysis with its command (issue 98): its package (its class and its call in the API among it), its command
module, and one row of the analyses' table (:data:`resumerge.config.analyses.ANALYSES`); nothing else is edited.
Before, it also took a row of the API's own ``ANALYSES`` (its object), a ``Command`` row in the CLI's table and an
entry in the API's lazy map. A toy analysis plugged in from outside, as the toy codec, the toy command and the toy
output format are: ``resumerge toy OUT TEXT`` makes its one front-door call (``resumerge.api.toy_count``), listed in
``resumerge --help`` and the command reference after the last analysis's; ``resumerge status OUT`` answers for its
folder through the one table, and a folder it does not hold is still nothing recorded; the stub type checkers read
would name its call (tests/test_api_stub.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import types
from pathlib import Path

import pytest

from resumerge.api import analyses as table
from resumerge.cli import commands, parsers, reference
from resumerge.config import analyses as rows
from resumerge.config.analyses import AnalysisRow
from resumerge.config.locations import StateDir
from resumerge.errors import EXIT_OK
from resumerge.merge.store.statusview import StatusReport

_FILE = "toy.json"


class _ToyAnalysis:
    """The toy package's analysis: a folder holding ``toy.json`` is its own; it journals under ``toys/``."""

    def holds(self, out: object, state: StateDir) -> bool:
        return (Path(str(out)) / _FILE).is_file()

    def status(self, out: object, state: StateDir) -> StatusReport:
        words = json.loads((Path(str(out)) / _FILE).read_text(encoding="utf-8"))["words"]
        return StatusReport(out_dir=str(out), state="done", source="toy", tensors_total=words, tensors_done=words,
                            shards_total=1, shards_done=1, bytes_total=0, bytes_done=0, resume_command=None,
                            kind="toy")

    def journal(self, state: StateDir) -> Path:
        return state.root / "toys"


def _toy_package() -> types.ModuleType:
    """The analysis's package: what it does (count the words of a text into OUT, journaled under the state dir)."""
    package = types.ModuleType("toy_analysis")

    def count(out: Path, text: str, state: StateDir) -> int:
        words = len(text.split())
        journal = _ToyAnalysis().journal(state)
        journal.mkdir(parents=True, exist_ok=True)
        (journal / "counted").write_text(str(out), encoding="utf-8")
        out.mkdir(parents=True, exist_ok=True)
        (out / _FILE).write_text(json.dumps({"words": words}), encoding="utf-8")
        return words

    def toy_count(out: Path, text: str, state_dir: Path | None = None) -> int:
        """The analysis's call in the API: where its journal goes, then the count."""
        return count(out, text, StateDir.resolve(state_dir))

    package.ToyAnalysis = _ToyAnalysis  # type: ignore[attr-defined]
    package.toy_count = toy_count  # type: ignore[attr-defined]
    return package


def _toy_command() -> types.ModuleType:
    """The analysis's command module, declared as ``cli/checkcmd.py`` is."""
    module = types.ModuleType("toy_analysis_cmd")
    module.HELP = "count the words of TEXT into OUT"  # type: ignore[attr-defined]
    module.DESCRIPTION = (  # type: ignore[attr-defined]
        "A toy analysis: its package, this module and one row of the analyses' table.")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("out", metavar="OUT", type=Path)
        parser.add_argument("text", metavar="TEXT")
        parser.add_argument("--state-dir", metavar="DIR", type=Path)

    def run(args: argparse.Namespace) -> int:
        from resumerge import api

        print(api.toy_count(args.out, args.text, state_dir=args.state_dir))  # type: ignore[attr-defined]
        return EXIT_OK

    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    return module


def _main(*words: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = commands.main(list(words))
    return code, out.getvalue()


def test_a_new_analysis_is_its_package_its_command_module_and_one_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    from test_api_stub import render

    from resumerge import api

    monkeypatch.setitem(sys.modules, "toy_analysis", _toy_package())
    monkeypatch.setitem(sys.modules, "toy_analysis_cmd", _toy_command())
    request.addfinalizer(lambda: vars(api).pop("toy_count", None))  # the API keeps a name it imported
    toy = AnalysisRow("toy", "toy_analysis_cmd:run", "toy_analysis:ToyAnalysis", ("toy_analysis:toy_count",))
    monkeypatch.setattr(rows, "ANALYSES", (*rows.ANALYSES, toy))  # the one row
    out, state = tmp_path / "counted", tmp_path / "state"

    assert _main("toy", str(out), "three small words", "--state-dir", str(state)) == (EXIT_OK, "3\n")
    assert (state / "toys" / "counted").read_text(encoding="utf-8") == str(out)  # journaled where it says

    code, shown = _main("status", "--json", "--state-dir", str(state), str(out))
    report = json.loads(shown)
    assert code == EXIT_OK and (report["kind"], report["state"], report["tensors_done"]) == ("toy", "done", 3)
    assert isinstance(table.analysis_of(out, StateDir.resolve(state)), _ToyAnalysis)
    assert table.analysis_of(tmp_path, StateDir.resolve(state)) is None  # a folder it does not hold
    assert api.toy_count(tmp_path / "again", "two words", state_dir=state) == 2  # type: ignore[attr-defined]
    assert "from toy_analysis import toy_count\n" in render() and '"toy_count"' in render()  # the stub follows

    listed = list(parsers.commands())  # --help's order: the analyses' commands, this one last, then demo's
    assert listed[listed.index("evolve"):] == ["evolve", "toy", "demo"]
    sub = next(a for a in parsers.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == listed
    text = reference.render()  # the command reference (docs/commands.md) reads the same row
    assert "| [`toy`](#resumerge-toy) | count the words of TEXT into OUT |" in text and "## resumerge toy\n" in text

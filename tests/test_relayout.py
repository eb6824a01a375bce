"""tools/relayout.py (issue 83's re-layout, run by the integrator once): on a small tree of the same shape it moves
packages and modules, rewrites every kind of reference, declares the new layers, and a second run changes nothing.
The script leaves this file alone (its old names are the inputs)."""

from __future__ import annotations

from pathlib import Path

from support import load_tool, relayout_again, write_files


def _tree(root: Path) -> None:
    write_files(root, {
        "resumerge/__init__.py": '"""resumerge."""\n',
        "resumerge/forward/__init__.py": '"""The forward engine.\n\nMay import: errors, plan (refs only).\n"""\n\n'
                                         '__all__: list[str] = []\n',
        "resumerge/plan/__init__.py": '"""The plan.\n\nMay import: errors.\n"""\n\n__all__: list[str] = []\n',
        "resumerge/plan/planner.py": '"""Plans (:mod:`.refs`)."""\n\nX = 1\n',
        "resumerge/plan/refs.py": '"""Refs."""\n',
        "resumerge/moe/__init__.py": '"""MoE.\n\nMay import: errors, forward, plan.\n"""\n\n__all__: list[str] = []\n',
        "resumerge/moe/passmain.py": '"""The gates\' pass (:mod:`resumerge.plan.planner`)."""\n\n'
                                     "from resumerge import plan\nfrom resumerge.plan.planner import X\n",
        "resumerge/analyses/__init__.py": '"""The analyses.\n\nMay import: errors, forward.\n"""\n\n'
                                          '__all__ = ["check"]\n',
        "resumerge/analyses/check/__init__.py": '"""Check.\n\nMay import: errors, forward.\n"""\n\n__all__ = []\n',
        "resumerge/analyses/check/vocabs.py": '"""Vocabularies (:mod:`.job` uses them)."""\n',
        "resumerge/analyses/check/job.py": '"""The job (:func:`~.vocabs.meet`)."""\n\n'
                                           "from resumerge.analyses.check.vocabs import __doc__ as D\n",
        "tests/test_x.py": 'import subprocess, sys\n\nTARGET = "resumerge.moe.passmain.X"\n'
                           'ARGS = [sys.executable, "-m", "resumerge.moe.passmain"]\n'
                           'PATH = "resumerge/moe/passmain.py"\n',
        "docs/architecture.md": "# Walks\n\nPaths are under `resumerge/`: `moe/passmain.py:main`, "
                                "`analyses/check/vocabs.py`.\n\n## A walk\n",
        "CHANGELOG.md": "- `resumerge.moe.passmain` (history: left alone)\n",
    })


def test_the_relayout_moves_rewrites_and_declares_once(tmp_path: Path) -> None:
    _tree(tmp_path)
    tool = load_tool("relayout")
    said = tool.relayout(tmp_path)
    pkg = tmp_path / "resumerge"
    assert "move resumerge/moe -> resumerge/runs/moe" in said
    assert (pkg / "runs" / "moe" / "passmain.py").is_file() and not (pkg / "moe").exists()
    assert (pkg / "merge" / "plan" / "planner.py").is_file() and not (pkg / "plan").exists()
    assert (pkg / "forward" / "vocabs.py").is_file() and not (pkg / "analyses" / "check" / "vocabs.py").exists()
    passmain = (pkg / "runs" / "moe" / "passmain.py").read_text()
    assert "from resumerge.merge import plan\n" in passmain
    assert "from resumerge.merge.plan.planner import X" in passmain
    assert ":mod:`resumerge.merge.plan.planner`" in passmain
    # A module left behind names its moved sibling absolutely; a moved one names the sibling it left likewise.
    assert ":func:`~resumerge.forward.vocabs.meet`" in (pkg / "analyses" / "check" / "job.py").read_text()
    assert "from resumerge.forward.vocabs import" in (pkg / "analyses" / "check" / "job.py").read_text()
    assert ":mod:`~resumerge.analyses.check.job`" in (pkg / "forward" / "vocabs.py").read_text() or \
        ":mod:`resumerge.analyses.check.job`" in (pkg / "forward" / "vocabs.py").read_text()
    test = (tmp_path / "tests" / "test_x.py").read_text()
    assert '"resumerge.runs.moe.passmain.X"' in test and '"-m", "resumerge.runs.moe.passmain"' in test
    assert '"resumerge/runs/moe/passmain.py"' in test
    doc = (tmp_path / "docs" / "architecture.md").read_text()
    assert "`runs/moe/passmain.py:main`" in doc and "`forward/vocabs.py`" in doc and "## The tree" in doc
    assert "resumerge.moe.passmain" in (tmp_path / "CHANGELOG.md").read_text()
    # The layers: the moved ones renamed in every line, the groups written, importing nothing.
    assert "May import: errors, forward, merge.plan." in (pkg / "runs" / "moe" / "__init__.py").read_text()
    assert "merge.plan (refs only)" in (pkg / "forward" / "__init__.py").read_text()
    assert "\nMay import:" not in (pkg / "runs" / "__init__.py").read_text()
    assert '__all__ = ["moe"]' in (pkg / "runs" / "__init__.py").read_text()
    assert "\nMay import:" not in (pkg / "analyses" / "__init__.py").read_text()
    assert relayout_again(tool, tmp_path) == []


def test_a_comment_or_docstring_pushed_past_the_line_is_refolded(tmp_path: Path) -> None:
    tool = load_tool("relayout")
    path = tmp_path / "m.py"
    long = "word " * 23 + "resumerge.merge.engine.cluster.kept"
    path.write_text(f'"""{long} more\nnext line."""\n\nX = 1  # {long}\nCODE = """{long} {long}"""\n')
    assert tool.fold_long_lines(path)
    lines = path.read_text().split("\n")
    assert all(len(line) <= 120 for line in lines[:-2])
    assert lines[-2].startswith("CODE = ")  # a string that is not a docstring is code: left alone

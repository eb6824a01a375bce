"""tools/relayout_clients.py (issue 98: forward/'s single-client modules back with their client): on a small tree of
the same shape it moves them, rewrites their references, and a second run changes nothing. The script leaves this
file alone (its old names are the inputs)."""

from __future__ import annotations

from pathlib import Path

from support import relayout_again, relayout_once


def _tree() -> dict[str, str]:
    return {
        "resumerge/__init__.py": '"""resumerge."""\n',
        "resumerge/forward/__init__.py": '"""The forward engine.\n\nMay import: errors.\n"""\n\n'
                                         '__all__ = ["ahead", "models", "stream"]\n',
        "resumerge/forward/stream.py": '"""A model\'s modules."""\n',
        "resumerge/forward/models.py": '"""The models a check compares (:mod:`.stream`)."""\n\n'
                                       "from resumerge.forward.stream import __doc__ as _\n\n\n"
                                       "def find_models() -> None: ...\n",
        "resumerge/forward/ahead.py": '"""Read-ahead."""\n',
        "resumerge/forward/layercache.py": '"""A layer\'s cache."""\n',
        "resumerge/analyses/__init__.py": '"""Analyses."""\n',
        "resumerge/analyses/check/__init__.py": '"""Check.\n\nMay import: errors, forward.\n"""\n\n__all__ = []\n',
        "resumerge/analyses/check/run.py": '"""Runs a check."""\n\nfrom resumerge.forward.models import find_models\n',
        "resumerge/analyses/importance/__init__.py": '"""Importance.\n\nMay import: forward.\n"""\n\n__all__ = []\n',
        "resumerge/runs/__init__.py": '"""Runs."""\n',
        "resumerge/runs/evolve/__init__.py": '"""Evolve.\n\nMay import: forward.\n"""\n\n__all__ = []\n',
        "tests/test_x.py": "from resumerge.forward import ahead, models\n\n"
                           "TARGET = \"resumerge.forward.layercache.x\"\n",
    }


def test_the_single_client_modules_go_to_their_clients_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    tool, said = relayout_once("relayout_clients", tmp_path, _tree())
    pkg = tmp_path / "resumerge"
    assert [p.name for p in sorted((pkg / "forward").glob("*.py"))] == ["__init__.py", "stream.py"]
    for moved in ("analyses/check/models.py", "analyses/importance/ahead.py", "runs/evolve/layercache.py"):
        assert (pkg / moved).is_file(), moved
    assert "from resumerge.analyses.check.models import find_models" in (pkg / "analyses/check/run.py").read_text()
    # the module's relative reference to a sibling it left is written whole
    assert ":mod:`resumerge.forward.stream`" in (pkg / "analyses/check/models.py").read_text()
    test = (tmp_path / "tests" / "test_x.py").read_text()
    assert "from resumerge.analyses.check import models" in test
    assert "from resumerge.analyses.importance import ahead" in test
    assert 'TARGET = "resumerge.runs.evolve.layercache.x"' in test
    assert '__all__ = ["stream"]' in (pkg / "forward" / "__init__.py").read_text()
    assert any("move resumerge/forward/models.py -> resumerge/analyses/check/models.py" in line for line in said)

    assert relayout_again(tool, tmp_path) == []

"""tools/relayout_forward.py (issue 98: forward/ in rooms by what they hold): on a small tree of the same shape it
moves each module into its room, writes the imports of the package's re-exported names from their modules, makes
forward/ a group, and a second run changes nothing. The script leaves this file alone (its old names are the
inputs)."""

from __future__ import annotations

import re
from pathlib import Path

from support import relayout_again, relayout_once


def _tree() -> dict[str, str]:
    return {
        "resumerge/__init__.py": '"""resumerge."""\n',
        "resumerge/forward/__init__.py": '"""The forward engine.\n\nMay import: errors.\n"""\n\n'
                                         "from resumerge.forward.reader import Weights\n\n"
                                         '__all__ = ["Weights"]\n',
        "resumerge/forward/reader.py": '"""Reads."""\n\n\nclass Weights: ...\n',
        "resumerge/forward/stream.py": '"""A model streamed (:mod:`.reader`, :mod:`.driver`)."""\n\n'
                                       "from resumerge.forward.reader import Weights as _\n",
        "resumerge/forward/driver.py": '"""The driver."""\n\nfrom resumerge.forward import stream\n',
        "resumerge/forward/native/__init__.py": '"""Native modules."""\n\n__all__ = []\n',
        "resumerge/forward/later.py": '"""A module a branch added."""\n',
        "resumerge/analyses/__init__.py": '"""Analyses."""\n',
        "resumerge/analyses/check/__init__.py": '"""Check.\n\nMay import: errors, forward.\n"""\n\n__all__ = []\n',
        "resumerge/analyses/check/run.py": '"""Runs a check."""\n\nfrom resumerge.forward import Weights, driver\n',
        "tests/test_x.py": 'TARGET = "resumerge.forward.stream.x"\nDOC = "resumerge/forward/native/config.py"\n'
                           "from resumerge.forward.stream import X, build_modules\n",
        "resumerge/forward/built.py": '"""Modules built."""\n',
    }


def test_forward_s_modules_go_to_their_rooms_and_a_second_run_changes_nothing(tmp_path: Path) -> None:
    tool, said = relayout_once("relayout_forward", tmp_path, _tree())
    pkg = tmp_path / "resumerge"
    for moved in ("forward/engine/reader.py", "forward/engine/stream.py", "forward/job/driver.py",
                  "forward/engine/native/__init__.py"):
        assert (pkg / moved).is_file(), moved
    run = (pkg / "analyses/check/run.py").read_text()
    assert "from resumerge.forward.engine.reader import Weights" in run
    assert "from resumerge.forward.job import driver" in run
    assert "from resumerge.forward.engine import stream" in (pkg / "forward/job/driver.py").read_text()
    # a reference to a sibling left behind in another room is written whole; one beside it stays relative
    stream = (pkg / "forward/engine/stream.py").read_text()
    assert ":mod:`.reader`" in stream and ":mod:`resumerge.forward.job.driver`" in stream
    test = (tmp_path / "tests/test_x.py").read_text()
    assert '"resumerge.forward.engine.stream.x"' in test and "resumerge/forward/engine/native/config.py" in test
    # a name that left its module when the module was split is imported from where it is now
    assert "from resumerge.forward.engine.built import build_modules" in test
    assert "from resumerge.forward.engine.stream import X" in test
    # forward/ is a group: its __init__ imports nothing and names its rooms; each room says what it may import
    group = (pkg / "forward/__init__.py").read_text()
    assert re.search(r"^May import:", group, re.MULTILINE) is None and "import " not in group.split('"""')[2]
    job = (pkg / "forward/job/__init__.py").read_text()
    assert "May import: errors, config, inputs, machine, forward.engine" in job
    assert '"stream"' in (pkg / "forward/engine/__init__.py").read_text()
    # a module no room names is left where it is, for a person to place
    assert (pkg / "forward/later.py").is_file()
    assert any("forward/later.py is in no room" in line for line in said)

    assert [line for line in relayout_again(tool, tmp_path) if "later.py" not in line] == []

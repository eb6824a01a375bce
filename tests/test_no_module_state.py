"""No module-level mutable state in the listed packages (read from the source with ast, nothing imported).

Per-run data kept in module globals is shared by every run of a process (two runs in one notebook see each other's)
and hides what a function depends on. A module of a listed package may bind names at module level only to values
that cannot change: constants, tuples, frozensets, functions, classes, frozen dataclass instances. This test fails
on an assignment of a dict, list or set display or comprehension, on a call of a mutable container's constructor
(``dict()``, ``OrderedDict()``, ``defaultdict()``, ``deque()``, ``WeakValueDictionary()``…), on a lock (a lock at
module level guards module-level data), and on any ``global`` statement. A constant table is a ``MappingProxyType``
over a dict display; ``__all__`` is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "resumerge"
PACKAGES = ("methods",)
MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray", "OrderedDict", "defaultdict", "deque", "Counter", "ChainMap",
    "WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "Lock", "RLock", "Condition", "Event", "Semaphore",
    "local",
})


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in MUTABLE_CALLS
    return False


def _findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [f"{path.name}:{node.lineno}: global statement" for node in ast.walk(tree)
             if isinstance(node, ast.Global)]
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if value is not None else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue  # the export list: a list by convention, never changed
        if value is not None and _mutable(value):
            found.append(f"{path.name}:{node.lineno}: module-level mutable value")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_level_mutable_state(package: str) -> None:
    found = [f for path in sorted((PACKAGE / package).rglob("*.py")) for f in _findings(path)]
    assert not found, "\n".join(found)


def test_the_scan_finds_what_it_forbids(tmp_path: Path) -> None:
    """A test that cannot fail is a defect: each forbidden form is found, and the allowed ones are not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import threading\nA = {}\nB: list[int] = []\nC = dict(a=1)\nD = threading.Lock()\n"
                   "E = {k: 1 for k in 'ab'}\n\ndef f() -> None:\n    global A\n")
    assert len(_findings(bad)) == 6
    good = tmp_path / "good.py"
    good.write_text("A = (1, 2)\nB = frozenset({1})\nC = 'x'\n\ndef f() -> dict[str, int]:\n    return {}\n")
    assert _findings(good) == []

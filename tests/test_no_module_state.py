"""No module-level mutable state in the packages that hold per-run work: what one run shares among its units
travels in its context's resources (:mod:`resumerge.merge.methods.resources`), so two runs in one process (a notebook)
never see each other's data.

An ast scan of every module of each package of :data:`PACKAGES`: a module-level assignment of a mutable display
or comprehension (``{}``, ``[]``, ``{1}``) or of a call that makes a mutable container or a lock, and any
``global`` statement, is refused (a lock at module level guards module-level data). Constants (tuples, frozensets,
functions, classes, frozen dataclass instances; a constant table is a ``MappingProxyType`` over a dict display) are
what a module may hold; ``__all__`` is exempt.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "resumerge"

# (paths under resumerge/: the packages moved under merge/ and runs/, and the old names left the scan empty, every
# test of it skipped, until :func:`test_each_package_scanned_holds_modules` said so)
PACKAGES = ("merge/methods", "runs/moe", "runs/extract")

# Calls whose result is a mutable container, or a lock that only makes sense guarding mutable data.
MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray", "OrderedDict", "defaultdict", "deque", "Counter", "ChainMap",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "Lock", "RLock", "Condition", "Semaphore",
    "BoundedSemaphore", "Event", "local", "Queue", "SimpleQueue", "LifoQueue", "PriorityQueue",
})
MUTABLE_DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _called(node: ast.expr) -> str | None:
    """The name a call's callee ends in (``threading.Lock`` -> ``Lock``), or None for another expression."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import: the module's own, and those nested in its ifs, loops, withs and trys
    (never a function's or a class's body)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            yield from _module_statements(getattr(stmt, name, []))
        for handler in getattr(stmt, "handlers", []):
            yield from _module_statements(handler.body)


def _names_all(stmt: ast.stmt) -> bool:
    """``__all__ = [...]``: the package's export list, read by tools, never written."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def findings(source: str, where: str) -> list[str]:
    """Every piece of module-level mutable state in ``source`` (named ``where`` in the messages)."""
    tree = ast.parse(source)
    found = [f"{where}:{node.lineno}: global statement" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    for stmt in _module_statements(tree.body):
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else None
        if value is None or _names_all(stmt):
            continue
        if isinstance(value, MUTABLE_DISPLAYS):
            found.append(f"{where}:{stmt.lineno}: module-level {type(value).__name__.lower()}")
        elif _called(value) in MUTABLE_CALLS:
            found.append(f"{where}:{stmt.lineno}: module-level {_called(value)}()")
    return found


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_each_package_scanned_holds_modules() -> None:
    assert all(len(list((ROOT / package).rglob("*.py"))) > 1 for package in PACKAGES), PACKAGES


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_level_mutable_state(path: Path) -> None:
    assert findings(path.read_text(), str(path.relative_to(ROOT))) == []


@pytest.mark.parametrize("source", [
    "_cache = {}", "_pending: OrderedDict[str, int] = OrderedDict()", "_lock = threading.Lock()",
    "def use(c):\n    global _cache\n    _cache = c", "if True:\n    seen = [x for x in range(3)]",
    "try:\n    import x\nexcept ImportError:\n    known = set()",
])
def test_the_scan_finds_each_kind_of_module_state(source: str) -> None:
    assert findings(source, "m.py")


@pytest.mark.parametrize("source", [
    "NAMES = ('a', 'b')", "KEEP = 8", "__all__ = ['a', 'b']", "TABLE = MappingProxyType({'a': 1})",
    "ALL = frozenset({'a'})",
    "def f():\n    seen = {}\n    return seen", "class C:\n    def __init__(self):\n        self.d = {}",
])
def test_the_scan_passes_constants_and_local_state(source: str) -> None:
    assert findings(source, "m.py") == []

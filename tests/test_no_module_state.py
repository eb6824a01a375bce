"""No module-level mutable state anywhere in the package: what one run shares among its units travels in its
context's resources (:mod:`resumerge.merge.methods.resources`), so two runs in one process (a notebook) never see
each other's data.

An ast scan of every module of resumerge (its top-level modules and each package of :data:`PACKAGES`): a
module-level assignment of a mutable display or comprehension (``{}``, ``[]``, ``{1}``) or of a call that makes a
mutable container or a lock, and any ``global`` statement, is refused (a lock at module level guards module-level
data). Constants (tuples, frozensets, functions, classes, frozen dataclass instances; a constant table is a
``MappingProxyType`` over a dict display) are what a module may hold; ``__all__`` is exempt. The few pieces of state
that are one per process by nature (a lock around a process-wide switch, what the C library or the interpreter holds
once) are named in :data:`ONE_PER_PROCESS`, each with why.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

import pytest

ROOT = Path(__file__).resolve().parents[1] / "resumerge"

# Every top-level package of resumerge/ (its subpackages are scanned with it); the modules beside them are scanned
# too. (A list of paths once named packages that had moved: the scan was empty, every test of it skipped, until
# :func:`test_each_package_scanned_holds_modules` said so.)
PACKAGES = tuple(sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()))

# ``path:name`` -> why that state is one per process by nature, not one per run (kept short: each a line).
ONE_PER_PROCESS: Mapping[str, str] = MappingProxyType({
    "api/lmevaldoor.py:_SWITCH": "guards the switch of lm_eval.simple_evaluate, one attribute every thread shares",
    "cli/knobs.py:_EXIT_HOOK": "atexit and signal handlers are the interpreter's: the hook is registered once",
    "machine/killpoints.py:_counts": "tests' RESUMERGE_KILL_AT names the Nth visit of a point in this process",
    "machine/killpoints.py:_stops": "tests' RESUMERGE_STOP_AT names the Nth visit of a point in this process",
    "machine/memory/allocator.py:_lock": "guards glibc's mallopt thresholds, set for the whole process",
    "machine/memory/allocator.py:_tuned": "the runs holding glibc's process-wide thresholds: the last one restores",
    "machine/torch_import.py:_PENDING": "settings waiting for torch's one import in the process",
    "machine/torch_import.py:_PENDING_LOCK": "guards the settings waiting for torch's one import",
    "merge/store/hubrepo.py:_XET_SWITCH": "guards HF_HUB_DISABLE_XET, one of huggingface_hub's process-wide constants",
    "merge/store/journal.py:_WRITERS": "SQLite's WAL-reset bug: one writing connection a file in the process",
    "merge/store/journal.py:_WRITERS_LOCK": "guards the one writing connection of each SQLite file in the process",
    "merge/store/shardwriter.py:_HASHER": "the process's one hashing thread (one writer thread writes every shard)",
    "merge/store/shardwriter.py:_HASHER_LOCK": "guards the start of the process's one hashing thread",
})

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


def _assigned(stmt: ast.stmt) -> str:
    """The names an assignment binds, comma-separated (``a, b = ...``: ``a,b``)."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    return ",".join(n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name))


def state(source: str) -> list[tuple[int, str, str]]:
    """Every piece of module-level mutable state in ``source``: (line, the name it binds, what it is)."""
    tree = ast.parse(source)
    found = [(node.lineno, name, "global statement") for node in ast.walk(tree) if isinstance(node, ast.Global)
             for name in node.names]
    for stmt in _module_statements(tree.body):
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) else None
        if value is None or _names_all(stmt):
            continue
        if isinstance(value, MUTABLE_DISPLAYS):
            found.append((stmt.lineno, _assigned(stmt), f"module-level {type(value).__name__.lower()}"))
        elif _called(value) in MUTABLE_CALLS:
            found.append((stmt.lineno, _assigned(stmt), f"module-level {_called(value)}()"))
    return found


def findings(source: str, where: str) -> list[str]:
    """Every piece of module-level mutable state in ``source`` (named ``where`` in the messages)."""
    return [f"{where}:{line}: {what}" for line, _, what in state(source)]


def _modules() -> list[Path]:
    """Every module of resumerge: those beside its packages, and each of every package of :data:`PACKAGES`."""
    return sorted({*ROOT.glob("*.py"), *(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))})


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_each_package_scanned_holds_modules() -> None:
    assert all(len(list((ROOT / package).rglob("*.py"))) > 1 for package in PACKAGES), PACKAGES
    assert set(_modules()) == set(ROOT.rglob("*.py")), "a module of resumerge/ that the scan leaves out"


@pytest.mark.parametrize("path", _modules(), ids=_where)
def test_no_module_level_mutable_state(path: Path) -> None:
    where = _where(path)
    assert [f"{where}:{line}: {what}" for line, name, what in state(path.read_text())
            if f"{where}:{name}" not in ONE_PER_PROCESS] == []


def test_each_state_kept_one_per_process_is_still_there() -> None:
    held = {f"{_where(p)}:{name}" for p in _modules() for _, name, _ in state(p.read_text())}
    assert set(ONE_PER_PROCESS) <= held, sorted(set(ONE_PER_PROCESS) - held)


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

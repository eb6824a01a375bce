"""The package's shape, read from the source (ast, nothing imported): layers, cycles, sizes.

Each subpackage's ``__init__.py`` docstring has a line ``May import: a, b, c`` naming the packages (and top-level
modules) it may import; a package is allowed itself and the leaf any module may import, ``errors`` (the bottom
package, ``machine``, is declared like any other). A top-level package whose docstring has no such line is a group (it
holds packages that belong together, and nothing else): each of its subpackages is a layer of its own, named
``group.sub`` in those lines (the group's name alone allows every layer it holds), and the group's ``__init__`` imports
nothing. This test builds the import graph of every module — imports inside functions and under
``TYPE_CHECKING`` included — and fails on an import a docstring does not allow, on any cycle between modules or
between packages, and on files that outgrow the size rules.
"""

from __future__ import annotations

import ast
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "resumerge"
# The groups (analyses, merge, runs: packages that hold layers), the layers beside them (api, cli, config, forward,
# inputs, machine, outputs), the leaf (errors), the package's own files and ``lm_eval.py``
# (``python -m resumerge.lm_eval``: lm-eval's command line with ``--model resumerge``). Issue 98 brought it to 15
# (memory/ and torch_import into machine/).
MAX_ENTRIES = 16
MAX_LINES = 600
# Settings travel as records (issue 83): no function takes more than this many parameters (self and cls aside).
MAX_PARAMETERS = 10
MAX_MEDIAN_LINES = 150
# The edge: the Python API and the root package (which re-exports it lazily) may import anything; so may the
# package's two ``python -m`` entry points.
EDGE = {"api", "__init__", "__main__", "lm_eval"}
# The top-level module every module may import: it imports nothing of resumerge.
LEAVES = ("errors",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """Every resumerge module ``path`` imports (``from pkg import submodule`` resolves to the submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.append(sub if sub in known else module)
        else:
            continue
        for target in targets:
            if target == "resumerge" or target.startswith("resumerge."):
                # ``import resumerge.a.b`` names a module; keep the longest known prefix.
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name:
                    yield target


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: set(_imports(path, name, known)) for name, path in modules.items()}


def _may_import(init: Path) -> set[str] | None:
    """The names of the ``May import:`` line of ``init``'s docstring, with the lines that continue it up to a blank
    line (None: it has none)."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    match = re.search(r"^May import: (.*(?:\n.+)*)", doc, re.MULTILINE)
    if match is None:
        return None
    listed = re.sub(r"\(.*?\)", "", match.group(1).replace("\n", " "), flags=re.DOTALL)
    names = {n.strip().rstrip(".").strip() for n in listed.split(",")}
    return {n for n in names if n and n != "nothing"}


def _groups(package: Path = PACKAGE) -> frozenset[str]:
    """The top-level packages that are groups: their ``__init__`` docstring has no ``May import:`` line."""
    return frozenset(init.parent.name for init in package.glob("*/__init__.py") if _may_import(init) is None)


def _top(module: str, groups: frozenset[str] | None = None) -> str:
    """The layer ``module`` belongs to: its top-level package, or ``group.sub`` inside a group."""
    groups = _groups() if groups is None else groups
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in groups:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def _allowed() -> dict[str, set[str]]:
    """Layer -> what its ``__init__`` docstring says it may import (a group's name standing for each of its layers)."""
    groups = _groups()
    declared: dict[str, set[str]] = {}
    inits = [*PACKAGE.glob("*/__init__.py"), *(p for g in groups for p in PACKAGE.glob(f"{g}/*/__init__.py"))]
    for init in sorted(inits):
        layer = ".".join(init.parent.relative_to(PACKAGE).parts)
        if layer in groups:
            continue
        names = _may_import(init)
        assert names is not None, f"{init.relative_to(PACKAGE.parent)}: the docstring has no 'May import:' line"
        declared[layer] = names
    return {layer: {each for name in names for each in (
        [other for other in declared if other.startswith(f"{name}.")] if name in groups else [name])}
        for layer, names in declared.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_package_says_its_job_what_it_may_import_and_its_public_names() -> None:
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if init.parent == PACKAGE:
            continue
        tree = ast.parse(init.read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree)
        where = init.relative_to(PACKAGE.parent)
        assert doc and doc.split("\n\n")[0].endswith("."), f"{where}: the docstring must open with its job"
        exported = [
            n for n in tree.body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
        ]
        assert exported, f"{where}: no __all__"


def test_a_group_holds_packages_only_and_imports_nothing() -> None:
    graph = _graph()
    for group in _groups():
        loose = [p.name for p in (PACKAGE / group).glob("*.py") if p.name != "__init__.py"]
        assert not loose, f"{group}/ is a group (no 'May import:' line): it holds packages only, not {loose}"
        assert not graph[f"resumerge.{group}"], f"{group}/__init__.py imports {sorted(graph[f'resumerge.{group}'])}"


def test_a_group_s_packages_are_layers_of_their_own(tmp_path: Path) -> None:
    # A group's subpackages are held apart like top-level packages: one imports another only where its line says so.
    (tmp_path / "runs" / "moe").mkdir(parents=True)
    (tmp_path / "runs" / "__init__.py").write_text('"""The kinds of run."""\n')
    moe = '"""MoE.\n\nMay import: errors (its\nhierarchy),\nanalyses."""\n'  # a line continued up to a blank line
    (tmp_path / "runs" / "moe" / "__init__.py").write_text(moe)
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "__init__.py").write_text('"""The inputs.\n\nMay import: errors."""\n')
    groups = _groups(tmp_path)
    assert groups == {"runs"}
    assert _top("resumerge.runs.moe.forward", groups) == "runs.moe"
    assert _top("resumerge.runs", groups) == "runs"
    assert _top("resumerge.inputs.model", groups) == "inputs"
    assert _may_import(tmp_path / "runs" / "moe" / "__init__.py") == {"errors", "analyses"}


def test_no_upward_import() -> None:
    allowed = _allowed()
    groups = _groups()
    wrong = []
    for module, targets in _graph().items():
        top = _top(module, groups)
        if top in groups:  # a group's own __init__ (it imports nothing: checked above)
            continue
        if top in EDGE:
            continue
        # Top-level modules other than the edge (errors, torch_import) import nothing of resumerge.
        may = allowed.get(top, set())
        for target in targets:
            other = _top(target, groups)
            if other in (top, *LEAVES) or other in may:
                continue
            wrong.append(f"{module} -> {target} ({top} may import: {', '.join(sorted(may)) or 'nothing'})")
    assert not wrong, "imports a layer does not allow:\n" + "\n".join(sorted(wrong))


def test_the_layers_have_no_cycle() -> None:
    allowed = _allowed()
    assert not _cycles({pkg: names - {pkg} for pkg, names in allowed.items()}), "the docstrings' layers loop"


def test_no_module_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles between modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_package_import_cycle() -> None:
    groups = _groups()
    graph: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        top = _top(module, groups)
        graph.setdefault(top, set()).update(_top(t, groups) for t in targets if _top(t, groups) != top)
    assert not _cycles(graph)


def test_the_api_never_imports_the_cli() -> None:
    """The CLI calls the API and hands in its progress display (only ``cli.render`` draws, it alone imports rich):
    no arrow runs from the API back up to the CLI."""
    groups = _groups()
    wrong = [f"{m} -> {t}" for m, targets in _graph().items() if _top(m, groups) == "api"
             for t in targets if _top(t, groups) == "cli"]
    assert not wrong


def test_sizes() -> None:
    entries = [p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= MAX_ENTRIES, f"{len(entries)} entries directly under resumerge/: {sorted(entries)}"
    lines = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.rglob("*.py")}
    big = [f"{p.relative_to(PACKAGE.parent)}: {n}" for p, n in lines.items() if n > MAX_LINES]
    assert not big, f"files over {MAX_LINES} lines: {big}"
    assert statistics.median(lines.values()) <= MAX_MEDIAN_LINES


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from resumerge.merge.store import ledger\n", {"resumerge.merge.store.ledger"}),
        ("from resumerge.merge.store.ledger import Ledger\n", {"resumerge.merge.store.ledger"}),
        ("import resumerge.merge.store.ledger\n", {"resumerge.merge.store.ledger"}),
        ("if TYPE_CHECKING:\n    from resumerge.merge.plan import merge_plan\n", {"resumerge.merge.plan.merge_plan"}),
        ("def f():\n    from resumerge.merge.store import Thing\n", {"resumerge.merge.store"}),
        ("from . import ledger\n", {"resumerge.merge.store.ledger"}),
    ],
)
def test_the_graph_sees_every_kind_of_import(tmp_path: Path, source: str, expected: set[str]) -> None:
    # The checks above are only as good as the graph: a form of import it missed would hide an upward edge.
    fake = tmp_path / "x.py"
    fake.write_text(source)
    known = {"resumerge.merge.store", "resumerge.merge.store.ledger",
             "resumerge.merge.plan", "resumerge.merge.plan.merge_plan"}
    assert set(_imports(fake, "resumerge.merge.store.x", known)) == expected


def test_a_cycle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The parameters of ``function`` as a caller gives them: every name, ``*args`` and ``**kwargs`` included,
    ``self`` and ``cls`` left out."""
    given = function.args
    names = [a.arg for a in (*given.posonlyargs, *given.args, *given.kwonlyargs)]
    names += [a.arg for a in (given.vararg, given.kwarg) if a is not None]
    return [name for name in names if name not in ("self", "cls")]


def test_no_function_takes_more_than_ten_parameters() -> None:
    # Issue 83: options a call takes grow as a record of them (the API's groups, Harness, Traits, InThisProcess),
    # not as one more parameter of every function they pass through.
    wide = sorted(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({len(_parameters(node))})"
                  for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  and len(_parameters(node)) > MAX_PARAMETERS)
    assert wide == []


def test_the_parameters_counted_are_what_a_caller_gives() -> None:
    (method,) = ast.parse("def f(self, a, /, b, *c, d, **e): pass").body
    assert isinstance(method, ast.FunctionDef) and _parameters(method) == ["a", "b", "d", "c", "e"]

"""``killpoints.POINTS`` is read from the code: exactly the points the package reaches, and no test names another.

The crash tests walk the tuples of :mod:`resumerge.machine.killpoints`; a point reached in the code but missing
there would never be walked, and a test that kills at a point nothing reaches would never kill."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from resumerge.machine import killpoints

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "resumerge"


def _is_reach(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr == "reach") or (isinstance(func, ast.Name)
                                                                           and func.id == "reach")


def _point_fields(trees: list[ast.Module]) -> dict[str, int]:
    """Classes with a ``point`` field (dataclasses such as AuxFile): class name -> the field's position."""
    fields: dict[str, int] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = [s.target.id for s in node.body
                         if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                if "point" in names:
                    fields[node.name] = names.index("point")
    return fields


def _points_used() -> set[str]:
    """Every point the package reaches: literals passed to ``reach``, and — where ``reach`` is handed a variable,
    which must be named ``point`` — the literals passed on as ``point=`` or as a ``point`` field."""
    trees = [ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))]
    fields = _point_fields(trees)
    used: set[str] = set()
    indirect = False
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if _is_reach(node):
                (arg,) = node.args
                if isinstance(arg, ast.Constant):
                    used.add(arg.value)
                else:
                    assert isinstance(arg, ast.Name) and arg.id == "point", ast.unparse(node)
                    indirect = True
                continue
            for keyword in node.keywords:
                if keyword.arg == "point" and isinstance(keyword.value, ast.Constant) and keyword.value.value:
                    used.add(keyword.value.value)
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name in fields and len(node.args) > fields[name] and isinstance(node.args[fields[name]], ast.Constant):
                used.add(node.args[fields[name]].value)
    assert indirect, "no reach(point) is left: drop the indirect rule above"
    return used


def test_points_lists_exactly_the_points_the_package_reaches() -> None:
    used = _points_used()
    assert set(killpoints.POINTS) == used, (f"reached but not listed: {sorted(used - set(killpoints.POINTS))}; "
                                            f"listed but never reached: {sorted(set(killpoints.POINTS) - used)}")
    assert len(killpoints.POINTS) == len(set(killpoints.POINTS))


def test_tests_kill_only_at_points_that_exist() -> None:
    literal = re.compile(r"""RESUMERGE_KILL_AT["']\]?\s*[:,=]\s*["']([a-z_]+)(?::\d+)?["']""")
    named = [(m.group(1), path.name) for path in ROOT.joinpath("tests").rglob("*.py")
             for m in literal.finditer(path.read_text())]
    assert len(named) > 10  # the pattern still matches how tests name their points
    unknown = [(point, where) for point, where in named if point not in killpoints.POINTS]
    assert unknown == []

"""docs/architecture.md's walks name a file and a function at each step: every ``path.py:Name`` (and
``path.py:Class.method``) it names is defined there, so a rename that leaves the walk behind fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`((?:[\w/]+/)?\w+\.py):(\w+(?:\.\w+)?)")


def _defined(path: Path) -> set[str]:
    """Every top-level function and class of ``path``, and each class's methods as ``Class.method``."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        if isinstance(node, ast.ClassDef):
            found |= {f"{node.name}.{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return found


def test_every_file_and_function_the_walks_name_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = NAMED.findall(text)
    assert len(named) >= 30  # both walks, step by step
    missing = [f"{file}:{name}" for file, name in named
               if not (ROOT / "resumerge" / file).is_file() or name not in _defined(ROOT / "resumerge" / file)]
    assert not missing, missing

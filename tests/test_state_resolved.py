"""Where the state dir is resolved (issue 83): at the front door (the API and the CLI), where ``config`` defines
it, and on a Ray node (``forward/placing/onray.py``: a node resolves the path it was sent). Below the API a pass
receives the :class:`~resumerge.config.locations.StateDir` the API resolved, so a pass never reads
``RESUMERGE_STATE_DIR`` or the default on its own. Read from the source (ast, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "resumerge"
FRONT = ("api", "cli", "config")
# Below the API: the Ray node alone, which resolves the path it was sent.
STILL = {"forward/placing/onray.py"}


def _resolving(path: Path) -> bool:
    """Whether ``path`` names ``StateDir.resolve`` (called, or handed on as a factory)."""
    return any(isinstance(node, ast.Attribute) and node.attr == "resolve" and isinstance(node.value, ast.Name)
               and node.value.id == "StateDir" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def test_below_the_api_a_pass_receives_the_state_dir_the_api_resolved() -> None:
    found = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
             if path.relative_to(PACKAGE).parts[0] not in FRONT and _resolving(path)}
    assert found <= STILL, f"resolves a state dir below the API: {sorted(found - STILL)}"
    assert not any(name.startswith("analyses/measure/") for name in found)


def test_a_factory_handed_on_is_found_too(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("state: StateDir = field(default_factory=StateDir.resolve)\n")
    (tmp_path / "y.py").write_text("state = given.resolve()\n")
    assert _resolving(tmp_path / "x.py") and not _resolving(tmp_path / "y.py")

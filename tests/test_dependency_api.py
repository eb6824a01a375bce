"""Dependencies through their public API only, and no library global left changed (issue 56).

resumerge reads huggingface_hub, transformers and Ray through what they export; where a supported line differs,
the one compatibility module (:mod:`resumerge.inputs.hub._hf`) bridges it, and a test runs it on each line
(``tests/hub/test_transformers4_stack.py`` for huggingface_hub 0.x). A process-wide switch of a library that one
call needs is set for that call and put back, correctly when threads do it at once.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

from huggingface_hub import constants, get_session

from resumerge.inputs.hub import _hf
from resumerge.merge.store.hubrepo import xet_disabled

ROOT = Path(__file__).resolve().parents[1] / "resumerge"
LIBRARIES = ("huggingface_hub", "transformers", "ray")


def _private_imports(path: Path) -> list[str]:
    """``module`` or ``module:name`` for each import of a library's private module or name in ``path``, imports
    under ``if TYPE_CHECKING:`` left out (mypy reads the names where they are defined; nothing runs them)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            found += [f"{node.module}:{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in LIBRARIES
                      and any(part.startswith("_") for part in a.name.split("."))]
    return found


def test_no_private_module_of_a_dependency_is_imported() -> None:
    found = {str(p.relative_to(ROOT.parent)): hits for p in sorted(ROOT.rglob("*.py")) if (hits := _private_imports(p))}
    assert found == {}


def test_the_http_client_is_the_one_the_public_session_comes_from() -> None:
    assert _hf._client().__name__ == type(get_session()).__module__.split(".")[0]
    assert (_hf._client().__name__ == "requests") is _hf._USES_REQUESTS


def test_xet_switch_is_put_back_when_threads_set_it_at_once() -> None:
    original = constants.HF_HUB_DISABLE_XET
    entered, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        with xet_disabled(original):
            second_in.set()
            first_out.wait(timeout=30)

    thread = threading.Thread(target=other)
    thread.start()
    with xet_disabled(not original):
        entered.set()
        # Unlocked, the other thread's scope opens here (saving our value) and, closing last, puts it back for good.
        second_in.wait(timeout=1.0)
    first_out.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert original == constants.HF_HUB_DISABLE_XET

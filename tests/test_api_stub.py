"""``resumerge/api/__init__.pyi``, what type checkers read of the API's names, is generated from its names and the
modules they live in (``_homes()``: its lazy map ``_LAZY``, then each analysis row's ``api``), never written by hand:
``python tests/test_api_stub.py`` writes it. A name added to either alone fails here until the stub is written
again."""

from __future__ import annotations

import textwrap
from pathlib import Path

from resumerge import api

STUB = Path(api.__file__).with_suffix(".pyi")


def render() -> str:
    """The stub: each name imported from its module, as ruff's isort lays the lines out, and ``__all__``."""
    homes: dict[str, list[str]] = {}
    for name, module in api._homes().items():
        homes.setdefault(module, []).append(name)
    lines = ['"""What type checkers read of :mod:`resumerge.api`: generated from its names by',
             '``python tests/test_api_stub.py``; not edited by hand."""', ""]
    for module in sorted(homes):
        names = sorted(homes[module])
        one = f"from {module} import {', '.join(names)}"
        lines += [one] if len(one) <= 120 else [f"from {module} import (", *(f"    {n}," for n in names), ")"]
    listed = textwrap.wrap(", ".join(f'"{name}"' for name in sorted(api._homes())), 116)
    return "\n".join([*lines, "", "__all__ = [", *(f"    {line}" for line in listed), "]", ""])


def test_the_stub_is_generated_from_the_lazy_map() -> None:
    assert STUB.read_text(encoding="utf-8") == render(), (
        "resumerge/api/__init__.pyi is behind the API's names: python tests/test_api_stub.py")


if __name__ == "__main__":
    STUB.write_text(render(), encoding="utf-8")

"""torch, imported when it is first used rather than when a module that uses it is imported.

Importing torch costs about 2 s of CPU (2.1 s measured on the bench machine), and no decision before the first
tensor needs it: reading the config, the inputs' headers, the plan, the locks, the ledger and OUT's reconciliation
are all metadata. A hub run's downloads start right after those, so every module that path reaches takes ``torch``
from here, and the import happens while the first input bytes arrive instead of before the first request
(``tests/test_torch_import.py`` keeps that path free of torch). Type checkers see the real module.

Import nothing from resumerge here: any module may import this one.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__all__ = ["IMPORT_RESERVE", "dtype_name", "load", "loaded", "torch"]

# More than importing torch adds to a process's anonymous memory (128 MB measured: CPU wheel 2.13, Python 3.11).
# A memory check made before the import counts this much for it; one that might fail by that margin imports
# torch first and measures instead (:func:`resumerge.engine.session.make_governor`).
IMPORT_RESERVE = 1 << 30


_FORWARDED = frozenset({"__version__", "__file__"})


class _OnFirstUse(types.ModuleType):
    """Stands in for ``torch`` until an attribute is read; then imports it and keeps each attribute read, so a
    later read of the same name is a plain attribute lookup."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name not in _FORWARDED:
            # Introspection (copy, pickle, doctest, typing) asks for dunders: that must not import torch.
            raise AttributeError(name)
        value = getattr(importlib.import_module("torch"), name)
        setattr(self, name, value)
        return value


def loaded() -> bool:
    """Whether torch itself has been imported in this process (by resumerge or anything else)."""
    return "torch" in sys.modules


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name without the module (``"float32"``): what tables kept by name are keyed by."""
    return str(dtype).removeprefix("torch.")


def load() -> None:
    """Import torch now (a memory reading that must include what it holds comes next)."""
    importlib.import_module("torch")


if TYPE_CHECKING:
    import torch as torch
else:
    torch = _OnFirstUse("torch")

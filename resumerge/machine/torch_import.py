"""torch, imported when it is first used rather than when a module that uses it is imported.

Importing torch costs about 2 s of CPU (2.1 s measured on the bench machine), and no decision before the first
tensor needs it: reading the config, the inputs' headers, the plan, the locks, the ledger and OUT's reconciliation
are all metadata. A hub run's downloads start right after those, so every module that path reaches takes ``torch``
from here, and the import happens while the first input bytes arrive instead of before the first request
(``tests/test_torch_import.py`` keeps that path free of torch). Type checkers see the real module.

A package defers its own names the same way, with one function (:func:`on_first_use`): ``resumerge status`` reads
a package's small modules without importing the large ones beside them.

Import nothing from resumerge here: any module may import this one.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

__all__ = ["IMPORT_RESERVE", "dtype_name", "load", "load_beside", "loaded", "on_first_use", "torch", "when_loaded"]

# More than importing torch adds to a process's anonymous memory (128 MB measured: CPU wheel 2.13, Python 3.11;
# 276 MB for CUDA 2.11+cu130 on a 16-core H100 machine, Python 3.12, without initialising CUDA).
# What a Ray actor declares for its process before its own work (resumerge.merge.engine.cluster,
# resumerge.forward.placing.rayactor). A local run's memory check counts torch through a fresh process's measured
# baseline instead (:mod:`resumerge.machine.memory.baseline`), without importing it.
IMPORT_RESERVE = 1 << 30


_FORWARDED = frozenset({"__version__", "__file__"})

# Settings of torch's own that wait for its import (:func:`when_loaded`), by what they set.
_PENDING: dict[str, Callable[[], None]] = {}
_PENDING_LOCK = threading.Lock()


def when_loaded(key: str, action: Callable[[], None] | None) -> None:
    """Run ``action`` once torch is imported: at once if it is, else when ``torch`` here is first used, before that
    use goes on. A later call with the same ``key`` replaces a pending action (None withdraws it), so a setting that
    waits is always the newest one. Lets a setting such as ``-j``'s thread count be taken before torch is needed
    without importing it then."""
    with _PENDING_LOCK:
        _PENDING.pop(key, None)
        if action is not None:
            _PENDING[key] = action
    if loaded():
        _run_pending()


def _run_pending() -> None:
    # One action at a time, outside the lock: an action uses torch, which may come back here.
    while True:
        with _PENDING_LOCK:
            if not _PENDING:
                return
            action = _PENDING.pop(next(iter(_PENDING)))
        action()


class _OnFirstUse(types.ModuleType):
    """Stands in for ``torch`` until an attribute is read; then imports it and keeps each attribute read, so a
    later read of the same name is a plain attribute lookup."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name not in _FORWARDED:
            # Introspection (copy, pickle, doctest, typing) asks for dunders: that must not import torch.
            raise AttributeError(name)
        module = importlib.import_module("torch")
        if _PENDING:
            _run_pending()
        value = getattr(module, name)
        setattr(self, name, value)
        return value


def on_first_use(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` (PEP 562) of ``package`` that gives each name of ``homes`` from the module
    ``homes`` names for it (relative to ``package`` when it starts with a dot), imported when the name is first
    read; any other name raises AttributeError, as a module without one does."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home, package), name)

    return __getattr__


def loaded() -> bool:
    """Whether torch itself has been imported in this process (by resumerge or anything else)."""
    return "torch" in sys.modules


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype``'s name without the module (``"float32"``): what tables kept by name are keyed by."""
    return str(dtype).removeprefix("torch.")


def load() -> None:
    """Import torch now (a memory reading that must include what it holds comes next)."""
    importlib.import_module("torch")
    _run_pending()


def load_beside() -> threading.Thread | None:
    """Start importing torch on a thread of its own, and return it (None where torch is imported already): work that
    leaves the interpreter's lock free meanwhile (a run's input proof reads its inputs with ``preadv``) goes on beside
    the import instead of before it. The first use of ``torch`` waits for the import to end; the settings waiting
    for torch (:func:`when_loaded`) are taken then, on the thread that uses it, not on this one (torch's thread count
    is a setting of each thread under OpenMP). An import that fails here is left to that first use, which raises
    it."""
    if loaded():
        return None
    thread = threading.Thread(target=_import_quietly, name="resumerge-torch-import", daemon=True)
    thread.start()
    return thread


def _import_quietly() -> None:
    with contextlib.suppress(Exception):  # imported again at its first use, which raises it
        importlib.import_module("torch")


if TYPE_CHECKING:
    import torch as torch
else:
    torch = _OnFirstUse("torch")

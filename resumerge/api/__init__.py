"""The front door: ``run``, ``resume``, ``status``, ``verify``, ``check``, ``estimate`` (what ``resumerge plan``
prints), ``plan_merge``, ``extract_lora``, ``estimate_extraction``, ``tokensurgeon``, ``estimate_tokensurgeon``
(:mod:`.transplanting`) and ``evolve`` (a search of a merge's parameters,
:mod:`.evolution`), for the CLI and for notebooks alike; ``open_unwritten`` and ``open_population``
(:mod:`.unwritten`): a merge config, or a generation of them, read as the model it describes without being written,
for ``eval`` and ``evolve``; ``evaluate`` (``resumerge eval``): lm-evaluation-harness tasks on a model, or on a merge
config unwritten; ``lm_eval`` (``resumerge lm-eval``): lm-eval's own command line with ``--model resumerge``.

Each CLI command parses its arguments and makes one call here, so a notebook gets the very tool the README
describes. Every call that writes a run, and ``evaluate``, takes its options as one frozen :class:`Settings`
(:mod:`.options`), whose
groups (:class:`Output`, :class:`Merging`, :class:`Resources`, :class:`Hub`, :class:`Stages`) it turns into the
:class:`~resumerge.merge.plan.merge_plan.PlanOptions` that change output bytes and the
:class:`~resumerge.config.settings.RunSettings` that do not, then hands the call to its kind of run: a single
merge, a recipe (several YAML documents), MoE upcycling (a mergekit-moe config) or a LoRA extraction, each one
class (:mod:`.runkind`) in the one tuple :data:`~resumerge.api.kinds.KINDS` walked by :mod:`.calls`. Errors are
the :mod:`resumerge.errors` exceptions that the CLI maps to exit codes.

The package imports every name on its first use (:func:`__getattr__`, from the module :func:`_homes` names):
``resumerge status`` imports :mod:`.reading` (``status``, ``recipe_status``, ``verify``, ``evolve_status``) and no
option group, no kind of run and no torch (issue 72: status under 0.2 s), while ``from resumerge.api import run`` and
``api.run(...)`` work as ever.

May import: errors, config, machine, merge.methods, merge.vocab, inputs, merge.store, merge.plan, outputs, runs.moe,
runs.extract, runs.transplant, merge.engine, runs.recipes, runs.evolve.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from resumerge.config import analyses as _analyses

# Where each name that is no analysis's lives (an analysis's: its row's ``api``, :mod:`resumerge.config.analyses`);
# ``__init__.pyi``, what type checkers read, is generated from :func:`_homes`: ``python tests/test_api_stub.py``.
_LAZY = MappingProxyType({
    **dict.fromkeys(("Harness", "Hub", "Lora", "Merging", "Output", "Resources", "Search", "Settings", "Stages",
                     "Surgery", "Trackers"), "resumerge.api.options"),
    **dict.fromkeys(("estimate_tokensurgeon", "tokensurgeon"), "resumerge.api.transplanting"),
    **dict.fromkeys(("open_population", "open_unwritten"), "resumerge.api.unwritten"),
    **dict.fromkeys(("recipe_status", "status", "verify"), "resumerge.api.reading"),
    **dict.fromkeys(("estimate", "estimate_extraction", "extract_lora", "plan_merge", "resume", "run"),
                    "resumerge.api.calls"),
})


def _homes() -> dict[str, str]:
    """Every name of the API and the module it lives in: :data:`_LAZY`'s, then each analysis row's."""
    offered = (call.partition(":") for row in _analyses.ANALYSES for call in row.api)
    return {**_LAZY, **{name: module for module, _, name in offered}}


__all__ = sorted(_homes())


def __getattr__(name: str) -> Any:
    """``name`` of :func:`_homes`, imported from its module on first use and kept here (the next use is a plain
    attribute)."""
    where = _homes().get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_homes()})

"""Look a merge method up by its mergekit name in the built-in list, or among a run's own units.

The built-in list (:data:`resumerge.merge.methods.builtin.BUILTIN`) is imported on first lookup, never at import time,
so that ``resumerge status`` never pays for importing torch; Python's module cache is the only memory of it. A kind
of run whose units are functions of its own (MoE upcycling's routers and experts, LoRA extraction's factors)
declares them in its own package and hands them in as ``units`` (its plan carries them, see
:attr:`resumerge.merge.plan.merge_plan.Plan.units`): they are never methods a config may name. The contract types are
re-exported here for callers outside the package.
"""

from __future__ import annotations

from collections.abc import Sequence

from resumerge.merge.methods.spec import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    Scope,
    declared,
)

__all__ = [
    "BasePolicy",
    "MergeContext",
    "MethodSpec",
    "ParamSpec",
    "Scope",
    "declared",
    "get_method",
    "method_names",
    "parameter_names",
]


def get_method(name: str, units: Sequence[MethodSpec] = ()) -> MethodSpec | None:
    """The built-in method called ``name``, else the one of ``units`` (a kind's own unit functions), else None."""
    from resumerge.merge.methods.builtin import BY_NAME  # lazily, as _builtin

    found = BY_NAME.get(name)
    return found if found is not None else next((spec for spec in units if spec.name == name), None)


def method_names() -> list[str]:
    """All built-in method names a config may name, sorted."""
    return sorted(spec.name for spec in _builtin())


def parameter_names() -> frozenset[str]:
    """Every parameter name some built-in method declares."""
    return frozenset(p.name for spec in _builtin() for p in spec.params)


def _builtin() -> tuple[MethodSpec, ...]:
    from resumerge.merge.methods.builtin import BUILTIN  # lazily: the method modules import torch

    return BUILTIN

"""Look a merge method up by its mergekit name, loading the built-in methods on first use.

The method modules import :mod:`resumerge.methods.spec` and register themselves there; this module sits above
them (it imports :mod:`resumerge.methods.builtin`), so lookups and registrations never form an import cycle. The
contract types are re-exported here for callers outside the package.
"""

from __future__ import annotations

from resumerge.methods.spec import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    Scope,
    register,
    registered,
)

__all__ = [
    "BasePolicy",
    "MergeContext",
    "MethodSpec",
    "ParamSpec",
    "Scope",
    "get_method",
    "method_names",
    "register",
]


def get_method(name: str) -> MethodSpec | None:
    """Return the method registered as ``name`` (loading the built-ins on first use), else None."""
    _load_builtins()
    return registered().get(name)


def method_names() -> list[str]:
    """All registered method names a config may name, sorted (not the engine's own units, such as MoE
    upcycling's expert and router functions, marked :attr:`MethodSpec.internal`)."""
    _load_builtins()
    return sorted(name for name, spec in registered().items() if not spec.internal)


def parameter_names() -> frozenset[str]:
    """Every parameter name some method a config may name declares."""
    _load_builtins()
    return frozenset(p.name for spec in registered().values() if not spec.internal for p in spec.params)


_loaded = False


def _load_builtins() -> None:
    # Imported lazily so that `resumerge status` never pays for importing torch.
    global _loaded
    if _loaded:
        return
    _loaded = True
    from resumerge.methods import builtin  # noqa: F401  (registers the built-in methods)

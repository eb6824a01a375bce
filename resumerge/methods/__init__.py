"""Merge methods: pure tensor functions registered under their mergekit names.

May import: nothing (methods are pure tensor functions).
"""

from resumerge.methods.registry import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    Scope,
    get_method,
    method_names,
    register,
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

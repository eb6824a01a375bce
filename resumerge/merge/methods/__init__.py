"""Merge methods: pure tensor functions, declared once each under their mergekit names.

May import: nothing (methods are pure tensor functions).
"""

from resumerge.merge.methods.registry import (
    BasePolicy,
    MergeContext,
    MethodSpec,
    ParamSpec,
    Scope,
    declared,
    get_method,
    method_names,
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
]

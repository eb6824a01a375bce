"""resumerge: crash-safe, resumable, memory-bounded merges of LLM weights from mergekit YAML configs.

The public Python API mirrors the CLI (``run``, ``resume``, ``status``, ``verify``, ``plan_merge``); it is
imported lazily so that ``import resumerge`` (and ``resumerge status``) never pays for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "plan_merge", "resume", "run", "status", "verify"]

if TYPE_CHECKING:
    from resumerge.api import plan_merge, resume, run, status, verify


def __getattr__(name: str) -> Any:
    if name in {"plan_merge", "resume", "run", "status", "verify"}:
        from resumerge import api

        return getattr(api, name)
    raise AttributeError(f"module 'resumerge' has no attribute {name!r}")

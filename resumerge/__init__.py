"""resumerge: crash-safe, resumable, memory-bounded merges of LLM weights from mergekit YAML configs.

The public Python API mirrors the CLI (``run``, ``resume``, ``status``, ``verify``, ``check``, ``measure``,
``plan_merge``, ``estimate``, ``recipe_status``, ``extract_lora``, ``estimate_extraction``, ``tokensurgeon``,
``estimate_tokensurgeon``), with its option groups (``Output``, ``Merging``, ``Resources``, ``Hub``, ``Stages``,
``Lora``, ``Surgery``); it is imported lazily so that
``import resumerge`` (and ``resumerge status``) never pays for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resumerge.config.version import __version__

__all__ = ["Hub", "Lora", "Merging", "Output", "Resources", "Stages", "Surgery", "__version__", "check", "estimate",
           "estimate_extraction", "estimate_tokensurgeon", "extract_lora", "measure", "plan_merge", "recipe_status",
           "resume", "run", "status", "tokensurgeon", "verify"]
_API = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:
    from resumerge.api import (
        Hub,
        Lora,
        Merging,
        Output,
        Resources,
        Stages,
        Surgery,
        check,
        estimate,
        estimate_extraction,
        estimate_tokensurgeon,
        extract_lora,
        measure,
        plan_merge,
        recipe_status,
        resume,
        run,
        status,
        tokensurgeon,
        verify,
    )


def __getattr__(name: str) -> Any:
    if name in _API:
        from resumerge import api

        return getattr(api, name)
    raise AttributeError(f"module 'resumerge' has no attribute {name!r}")

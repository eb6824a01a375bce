"""resumerge: crash-safe, resumable, memory-bounded merges of LLM weights from mergekit YAML configs.

The public Python API is :mod:`resumerge.api`'s, every name of its ``__all__`` reachable here as ``resumerge.NAME``
(derived from it, not copied: a name the API exports is exported here too), but for a name one of the package's own
modules holds (``lm_eval``, the module of ``python -m resumerge.lm_eval``): importing that module binds its name here,
so that call is ``resumerge.api.lm_eval``, and ``__all__`` leaves it out. The API imports its calls on their first
use, so that ``import resumerge`` (and ``resumerge status``) never pays for importing torch.
"""

from __future__ import annotations

import pkgutil
from typing import TYPE_CHECKING, Any

from resumerge import api as _api
from resumerge.config.version import __version__

# The package's own modules and subpackages (one listing of this folder): an API name among them is left out.
_OWN = frozenset(each.name for each in pkgutil.iter_modules(__path__))
_EXPORTED = frozenset(_api.__all__) - _OWN
__all__ = [*sorted(_EXPORTED), "__version__"]

if TYPE_CHECKING:
    from resumerge.api import *  # noqa: F403  (the names of api.__all__, for type checkers)


def __getattr__(name: str) -> Any:
    """``name`` of :data:`resumerge.api.__all__`, as :mod:`resumerge.api` gives it (imported there on first use)."""
    if name in _api.__all__:  # a module's name too is served until that module is imported (as it always was)
        return getattr(_api, name)
    raise AttributeError(f"module 'resumerge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

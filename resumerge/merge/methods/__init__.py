"""Merge methods: pure tensor functions, declared once each under their mergekit names.

May import: machine (torch, imported on first use: methods are pure tensor functions).
"""

from resumerge.merge.methods import registry
from resumerge.merge.methods.registry import *  # noqa: F403  (the registry's names: its __all__ is this package's)

__all__ = registry.__all__

"""Imports every built-in method module so that each registers itself (one line per module)."""

from resumerge.methods import linear, passthrough  # noqa: F401

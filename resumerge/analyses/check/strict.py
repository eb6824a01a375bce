"""A check's report as strict JSON: every number finite, so that any language's parser reads it (Node's
``JSON.parse``, Go's ``encoding/json``, serde, Python's ``json`` with ``parse_constant`` refusing) — Python's
``json.dumps`` writes a NaN as the bare word ``NaN``, which none of them accepts, and a broken merge is exactly
where the figures are not finite.

The rule: a non-finite number is written as ``null`` and its key gets a sibling ``<key>_nonfinite`` saying what it
was (``"nan"``, ``"inf"``, ``"-inf"``); in a list, the sibling maps each such element's index to what it was.
:func:`restore` reverses it, so the report read back from ``report.json`` is the report that was written."""

from __future__ import annotations

import math
from typing import Any

SUFFIX = "_nonfinite"


def finite(doc: Any) -> Any:
    """A copy of ``doc`` with each non-finite float as ``null`` and its ``<key>_nonfinite`` sibling beside it."""
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for key, value in doc.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
                out[key + SUFFIX] = _name(value)
            elif isinstance(value, (list, tuple)) and any(_odd(v) for v in value):
                out[key] = [None if _odd(v) else finite(v) for v in value]
                out[key + SUFFIX] = {str(i): _name(v) for i, v in enumerate(value) if _odd(v)}
            else:
                out[key] = finite(value)
        return out
    if isinstance(doc, (list, tuple)):
        return [finite(v) for v in doc]
    return doc


def restore(doc: Any) -> Any:
    """What :func:`finite` made, with its non-finite numbers back (the siblings gone)."""
    if isinstance(doc, dict):
        out = {key: restore(value) for key, value in doc.items() if not key.endswith(SUFFIX)}
        for key, value in doc.items():
            if not key.endswith(SUFFIX) or key[:-len(SUFFIX)] not in out:
                continue
            name = key[:-len(SUFFIX)]
            if isinstance(value, str):
                out[name] = float(value)
            elif isinstance(value, dict) and isinstance(out[name], list):
                out[name] = [float(value[str(i)]) if str(i) in value else v for i, v in enumerate(out[name])]
        return out
    if isinstance(doc, list):
        return [restore(v) for v in doc]
    return doc


def _odd(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _name(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")

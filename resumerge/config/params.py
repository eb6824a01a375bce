"""Parameter settings as mergekit writes them, and their evaluation for one tensor.

A setting is a scalar, a gradient (list of numbers interpolated over a slice's layers), a list of bools or
strings (indexed by position), or a conditional list ``[{filter: mlp, value: ...}, {value: ...}]`` where the
first entry whose filter matches the tensor name wins (see :func:`filter_matches`; a missing filter or ``"*"``
matches anything). A conditional list in which nothing matches yields no value, so resolution falls through to the
next level.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Any

Setting = Any  # scalar | list[number] | list[bool | str] | list[{filter?, value}]

_MISSING = object()
# A filter holding one of these is a glob pattern over the whole name (issue 44; mergekit PR #689 asks for globs).
_GLOB_CHARS = frozenset("*?[")


def check_setting(value: Any) -> str | None:
    """Return a one-sentence problem with the *form* of ``value``, or None when it is a valid setting."""
    if _is_scalar(value):
        return None
    if isinstance(value, list):
        if not value:
            return "a parameter list must not be empty"
        if all(isinstance(v, dict) for v in value):
            for i, entry in enumerate(value):
                extra = sorted(set(entry) - {"filter", "value"})
                if extra or "value" not in entry:
                    return f"conditional entry {i} must have 'value' and optionally 'filter'"
                if entry.get("filter") is not None and not isinstance(entry["filter"], str):
                    return f"conditional entry {i}: filter must be a string"
                inner = check_setting(entry["value"])
                if inner or (isinstance(entry["value"], list) and isinstance(entry["value"][0], dict)):
                    return f"conditional entry {i}: {inner or 'values cannot be nested conditionals'}"
            return None
        if all(_is_number(v) for v in value) or all(isinstance(v, (bool, str)) for v in value):
            return None
        return "a parameter list must hold only numbers (a gradient), only bools/strings, or only {filter, value}"
    return f"unsupported parameter value of type {type(value).__name__}"


def evaluate(setting: Setting, tensor_name: str, t: float) -> Any:
    """Return the value of ``setting`` for ``tensor_name`` at layer position ``t`` in [0, 1].

    Returns the module-level ``MISSING`` sentinel (see :func:`is_missing`) when a conditional list has no match.
    """
    if isinstance(setting, list) and setting and isinstance(setting[0], dict):
        for entry in setting:
            filt = entry.get("filter")
            if is_catch_all(filt) or filter_matches(filt, tensor_name):
                return evaluate(entry["value"], tensor_name, t)
        return _MISSING
    if isinstance(setting, list):
        if all(_is_number(v) for v in setting):
            return gradient_value([float(v) for v in setting], t)
        return setting[int(t * (len(setting) - 1))]
    return setting


def filter_matches(pattern: str, tensor_name: str) -> bool:
    """Whether a conditional entry's ``filter`` selects ``tensor_name``: a glob (a pattern holding ``*``, ``?`` or
    ``[``) matches the *whole* name, case-sensitively, with :func:`fnmatch.fnmatchcase` rules
    (``model.layers.*.mlp.experts.*``); any other pattern is a substring of the name, exactly as mergekit matches
    it (``self_attn``)."""
    return fnmatchcase(tensor_name, pattern) if is_glob(pattern) else pattern in tensor_name


def is_glob(pattern: str) -> bool:
    """Whether filter ``pattern`` is a glob (holds ``*``, ``?`` or ``[``) rather than mergekit's substring."""
    return not _GLOB_CHARS.isdisjoint(pattern)


def is_catch_all(pattern: str | None) -> bool:
    """Whether ``pattern`` is a conditional entry's catch-all: no filter, or mergekit's ``"*"``."""
    return pattern is None or pattern == "*"


def is_missing(value: Any) -> bool:
    """True when :func:`evaluate` found no matching conditional entry."""
    return value is _MISSING


def gradient_value(points: list[float], t: float) -> float:
    """Piecewise-linear interpolation of ``points`` at ``t`` (mergekit's rule: s = t·(n−1), i = ⌊s⌋)."""
    if len(points) == 1:
        return points[0]
    s = t * (len(points) - 1)
    i = min(math.floor(s), len(points) - 1)
    frac = s - i
    j = min(i + 1, len(points) - 1)
    return (1 - frac) * points[i] + frac * points[j]


def coerce(value: Any, kind: type) -> Any:
    """Convert a resolved value to the parameter's type; raises ``ValueError`` with a short reason."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "false"}:
            return value.lower() == "true"
        raise ValueError(f"expected true or false, got {value!r}")
    if kind in (float, int):
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        if isinstance(value, str):
            try:
                value = float(value)  # YAML 1.1 reads "1e-3" as a string; mergekit accepts it as a number
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        if not _is_number(value) or not math.isfinite(float(value)):
            raise ValueError(f"expected a finite number, got {value!r}")
        return int(value) if kind is int else float(value)
    return value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_whole(v: object) -> bool:
    """Whether ``v`` (a value read from YAML or JSON) is a whole number: an ``int``, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool, str))

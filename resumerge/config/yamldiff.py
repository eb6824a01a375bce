"""What differs between two versions of a config, in the user's own YAML paths.

A run refused because its plan changed says *what* changed: ``models[0].parameters.weight 0.5 → 0.6``, not "the
plan changed". The two texts are compared as parsed YAML, so comments, quoting and key order never count.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

# A sentence lists this many differences, then how many more there are.
SHOWN = 3


def config_changes(before: str, after: str) -> list[str]:
    """Each difference between the YAML texts ``before`` and ``after`` as ``PATH OLD → NEW`` (``PATH added: NEW``,
    ``PATH removed (was OLD)``), in document order, at most :data:`SHOWN` and a count of the rest; empty when they
    parse alike or either is not valid YAML (the caller then says what it knows otherwise)."""
    try:
        old = [d for d in yaml.safe_load_all(before) if d is not None]
        new = [d for d in yaml.safe_load_all(after) if d is not None]
    except yaml.YAMLError:
        return []
    found: list[str] = []
    if len(old) == 1 and len(new) == 1:
        _walk(old[0], new[0], "", found)
    else:
        _walk(old, new, "document", found)
    if len(found) > SHOWN:
        return [*found[:SHOWN], f"and {len(found) - SHOWN} more change(s) in the config"]
    return found


def _walk(old: Any, new: Any, path: str, found: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*new, *(k for k in old if k not in new)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in old:
                found.append(f"{where} added: {_show(new[key])}")
            elif key not in new:
                found.append(f"{where} removed (was {_show(old[key])})")
            else:
                _walk(old[key], new[key], where, found)
    elif isinstance(old, list) and isinstance(new, list):
        for i in range(max(len(old), len(new))):
            where = f"{path}[{i}]"
            if i >= len(old):
                found.append(f"{where} added: {_show(new[i])}")
            elif i >= len(new):
                found.append(f"{where} removed (was {_show(old[i])})")
            else:
                _walk(old[i], new[i], where, found)
    elif old != new or type(old) is not type(new):
        found.append(f"{path or 'the config'} {_show(old)} → {_show(new)}")


def _show(value: Any) -> str:
    """``value`` as the user would write it on one line (strings bare, the rest as JSON flow style)."""
    if isinstance(value, str):
        return value
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."

"""The JSON a plan's fingerprint hashes: compact, keys sorted, a dataclass as :func:`dataclasses.asdict` renders it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, is_dataclass
from typing import Any


def _json_default(value: Any) -> Any:
    """What JSON cannot write as it is: a dataclass as :func:`dataclasses.asdict` renders it, anything else (a set,
    a codec's identity) as a list."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return list(value)


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_default)


def sha(value: Any) -> str:
    return hashlib.sha256(dumps(value).encode()).hexdigest()

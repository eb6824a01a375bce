"""Facts of a config.json and the installed transformers alone (what transformers builds from it on the meta
device), kept in resumerge's cache (:func:`~resumerge.config.locations.cache_root`) so that a later process finds
them without importing transformers: its import is about 3-4 CPU s of a small command's start, and every resume,
every start of a search and every re-plan asked the same question again.

A fact is kept under a key of what it depends on: its kind and format, resumerge's version, transformers' version
and where transformers is imported from (a folder put before the installed one, another transformers, is another
key), and the config. Only answers transformers gave are kept: where it is missing or its import fails, nothing is
(installing or fixing it takes effect at once). A file that cannot be read is ignored; a lost or torn write costs
one build, never a wrong answer (written to a temp file, then renamed).

May import: config (nothing else of resumerge's own).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from resumerge.config.locations import cache_root, replace_text
from resumerge.config.version import __version__


def fact_path(kind: str, form: int, config: Any, cache_dir: Path | None = None) -> Path | None:
    """Where fact ``kind`` (kept in format ``form``) of ``config`` (JSON-serialisable, or its text) is kept under
    ``cache_dir`` (default :func:`~resumerge.config.locations.cache_root`); None where transformers is not installed
    (nothing is kept for it)."""
    try:
        version = importlib.metadata.version("transformers")
        found = importlib.util.find_spec("transformers")  # found on the path, not imported
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if found is None:
        return None
    text = json.dumps([form, __version__, version, found.origin, config], sort_keys=True, default=str)
    root = cache_dir if cache_dir is not None else cache_root()
    return root / kind / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def recalled(path: Path) -> Any | None:
    """The fact kept at ``path`` as JSON; None where none is, or it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def keep(path: Path, fact: Any) -> None:
    """Keep ``fact`` (JSON) at ``path``; a cache: where it cannot be written, the next process builds it again."""
    with contextlib.suppress(OSError):
        replace_text(path, json.dumps(fact))

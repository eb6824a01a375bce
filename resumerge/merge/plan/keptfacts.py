"""What transformers answered about a config, kept in resumerge's cache
(:func:`~resumerge.config.locations.cache_root`) per question, config and installation.

A stack of slices asks transformers three things of its configs: which keys its family holds per layer
(:func:`~resumerge.merge.plan.layerfacts.class_per_layer_keys`), which tables its donor packs per layer
(:func:`~resumerge.merge.plan.packing.packed_tables`) and whether the output config builds as the stack describes
(:func:`~resumerge.merge.plan.buildcheck.check_built`). Each imports transformers (its modeling code and torch with it):
4.6 to 5.1 of the 6.3 CPU s a DELLA slice over layers 0-8 of four 1.74 GB Llamas spent before its first unit on the
bench's machine, on every run, for answers that depend on the configs and the installed transformers and torch alone.
A plan asked the same again reads the answer here and imports neither (torch is then imported beside the run's start,
as for any other plan).

Only answers transformers gave are kept, by the caller's choice: a missing or broken transformers, a family it cannot
build and a refusal are found again each time, so installing or fixing it takes effect at once and a refusal always
says what it says now. A file that cannot be read is ignored; a lost or torn write costs one answer found again, never
a wrong one (written to a temp file, then renamed).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from resumerge.config.locations import kept_file, replace_text

# Bumped whenever what is kept, or a rule that finds an answer kept here, changes: an older file is then never read.
_FORMAT = 1
_FOLDER = "transformers-facts"


# What answers besides the config: transformers' and torch's versions, and the folder transformers is imported from
# (one put before the installed one, another transformers, is another answer).
Installed = tuple[str, str, str]


def installed() -> Installed | None:
    """The versions of transformers and torch that would answer and where transformers would be imported from (a
    kept answer's other facts), found without importing either; None where either cannot be found (not installed,
    or its import made to fail)."""
    try:
        found = importlib.util.find_spec("transformers")
        if found is None or importlib.util.find_spec("torch") is None:
            return None
        return importlib.metadata.version("transformers"), importlib.metadata.version("torch"), str(found.origin)
    except (ImportError, ValueError):  # a module whose spec cannot be found (a stand-in without one)
        return None


def _path(question: str, key: Any, versions: Installed, cache_dir: Path | None) -> Path:
    return kept_file(_FOLDER, [_FORMAT, *versions, question, key], f"{question}-", cache_dir)


def kept(question: str, key: Any, versions: Installed, cache_dir: Path | None = None) -> tuple[bool, Any]:
    """(True, the answer) kept for ``question`` about ``key`` (JSON-able facts) under these ``versions``, or
    (False, None) where none can be read (none yet, torn, another form)."""
    try:  # a key JSON cannot sort (keys of mixed types, which no config.json holds) is never kept either
        doc = json.loads(_path(question, key, versions, cache_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False, None
    if not isinstance(doc, dict) or "answer" not in doc:
        return False, None
    return True, doc["answer"]


def keep(question: str, key: Any, versions: Installed, answer: Any, cache_dir: Path | None = None) -> None:
    """Keep ``answer`` (JSON-able) for ``question`` about ``key`` under ``versions`` (a cache: an answer not kept
    costs finding it again next time, nothing else)."""
    with contextlib.suppress(OSError, TypeError, ValueError):
        replace_text(_path(question, key, versions, cache_dir), json.dumps({"answer": answer}))

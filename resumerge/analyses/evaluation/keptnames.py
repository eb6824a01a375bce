"""The names lm-eval's own task index holds (tasks, groups, tags), kept in resumerge's cache
(:func:`~resumerge.config.locations.cache_root`) per installation of lm-eval, so that an unknown name is refused
without building lm-eval's ``TaskManager``: it reads ~14,700 task YAMLs (and imports lm-eval, datasets with it) before
a name can be checked, 16 s of a refusal on a loaded machine.

A kept set is read only under the key it was written for: lm-eval's version, where its tasks folder is and that
folder's listing (every file's path, size and modification time: a task added, removed or edited is another key), the
format of this file (and resumerge's version: :func:`~resumerge.config.locations.kept_file`). Without one (none yet,
unreadable, another key, a folder that cannot be listed or holds a link) the caller builds the ``TaskManager`` as
before, which then keeps its names for the next time. The set only ever refuses: a name in it still goes through
lm-eval's full path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.config.locations import kept_file

# Bumped whenever what is kept, or how its key is found, changes: an older file is then never read.
_FORMAT = 1
_FOLDER = "lm-eval-tasks"


def lm_eval_tasks() -> tuple[str, Path] | None:
    """lm-eval's version and the folder of its own task YAMLs (what ``TaskManager`` indexes by default), found
    without importing lm-eval (its import alone takes seconds); None where it is not installed."""
    try:
        found = importlib.util.find_spec("lm_eval")
        if found is None or found.origin is None:
            return None
        return importlib.metadata.version("lm_eval"), Path(found.origin).parent / "tasks"
    except (ImportError, ValueError):
        return None


def listing_fingerprint(folder: Path) -> str | None:
    """A digest of every file under ``folder`` (its path there, size and modification time in ns); None where the
    folder cannot be listed whole or holds a symbolic link (what it points at could change unseen)."""
    entries: list[tuple[str, int, int]] = []
    pending = [folder]
    try:
        while pending:
            with os.scandir(pending.pop()) as found:
                for entry in found:
                    if entry.is_symlink():
                        return None
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
                        continue
                    stat = entry.stat(follow_symlinks=False)
                    entries.append((os.path.relpath(entry.path, folder), stat.st_size, stat.st_mtime_ns))
    except OSError:
        return None
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


@dataclass(frozen=True)
class KeptTaskNames:
    """The kept set of lm-eval's own task names for one installation: ``key`` (JSON-able) names its file and must
    match the one written inside it."""

    key: tuple[Any, ...]
    cache_dir: Path | None = None

    @classmethod
    def here(cls, cache_dir: Path | None = None) -> KeptTaskNames | None:
        """The kept set of the lm-eval installed here; None where lm-eval or a fingerprint of its tasks folder
        cannot be found (nothing is then kept or trusted)."""
        installed = lm_eval_tasks()
        if installed is None:
            return None
        version, folder = installed
        fingerprint = listing_fingerprint(folder)
        if fingerprint is None:
            return None
        return cls((_FORMAT, version, str(folder), fingerprint), cache_dir)

    @property
    def path(self) -> Path:
        return kept_file(_FOLDER, list(self.key), "names-", self.cache_dir)

    def names(self) -> frozenset[str] | None:
        """The names kept under this key; None where none can be read (none yet, torn, another key)."""
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("key") != list(self.key) or not isinstance(doc.get("names"), list):
            return None
        if not all(isinstance(name, str) for name in doc["names"]):
            return None
        return frozenset(doc["names"])

    def keep(self, names: Iterable[str]) -> None:
        """Keep ``names`` (lm-eval's default ``TaskManager``'s ``all_tasks``) under this key, durably (temp, fsync,
        rename, fsync of the folder); a cache: a set not kept costs building the index next time, nothing else."""
        from resumerge.errors import StorageError
        from resumerge.machine.durable import write_file_atomic

        text = json.dumps({"key": list(self.key), "names": sorted(names)})
        with contextlib.suppress(OSError, StorageError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(self.path, text.encode())

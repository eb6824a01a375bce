"""Whether a model reference names a local path or a hub repo, in a module of its own: a run over local models
decides it for each and imports nothing of the hub's client (:mod:`.resolve` does)."""

from __future__ import annotations

import os

from resumerge.config.merge_config import near_key
from resumerge.config.modelref import ModelRef


def is_local(ref: ModelRef) -> bool:
    """Return whether ``ref.path`` exists on disk; mergekit's rule is that anything else is a hub repo id."""
    return os.path.exists(os.path.expanduser(ref.path))


def local_parent(path: str) -> bool:
    """Whether ``path`` (a model reference no file or folder answers) has a parent that is a local folder: it was
    likely meant as a path (``models/smol-noisey`` beside ``models/``), whatever the hub may hold of that name."""
    parent = os.path.dirname(os.path.expanduser(path.rstrip("/")))
    return bool(parent) and os.path.isdir(parent)


def near_folder(path: str) -> str | None:
    """The folder beside ``path`` (a model reference no file or folder answers) whose name is most likely what was
    meant, spelled as ``path`` is (``models/smol-noisy`` for ``models/smol-noisey``: a typo, not a hub repo); None
    where ``path`` has no local parent (a hub id such as ``gpt2`` or ``org/name``) or no name there is close."""
    if not local_parent(path):
        return None
    parent, name = os.path.split(path.rstrip("/"))
    try:
        folders = [e.name for e in os.scandir(os.path.expanduser(parent)) if e.is_dir()]
    except OSError:
        return None
    near = near_key(name, folders)
    return None if near is None else os.path.join(parent, near)

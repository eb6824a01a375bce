"""Whether a model reference names a local path or a hub repo, in a module of its own: a run over local models
decides it for each and imports nothing of the hub's client (:mod:`.resolve` does)."""

from __future__ import annotations

import os

from resumerge.config.modelref import ModelRef


def is_local(ref: ModelRef) -> bool:
    """Return whether ``ref.path`` exists on disk; mergekit's rule is that anything else is a hub repo id."""
    return os.path.exists(os.path.expanduser(ref.path))

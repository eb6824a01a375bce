#!/usr/bin/env python3
"""Issue 98's third step: the modules of ``forward/`` that serve one client alone, back with that client, as a
script the integrator runs again once every branch has merged (others edit ``forward/`` in parallel).

``forward/models.py`` (the models a check compares, read from a merge's record: check's alone) goes to
``analyses/check/``; ``forward/ahead.py`` (the importance pass's read-ahead) to ``analyses/importance/``;
``forward/layercache.py`` (a search's cache of a layer's inputs) to ``runs/evolve/``. Every reference is rewritten
with tools/relayout.py's rewriters (dotted names, ``from resumerge.a import b``, paths, relative ``:mod:``
references), the imports it touched sorted and long docstring lines refolded, the ``May import:`` lines kept true
(tools/relayout_machine.py's); the packages left no longer list the modules in ``__all__``. Idempotent: on a moved
tree it only rewrites the references a merged branch still writes the old way; a module some branch adds again at an
old path is refused (both exist: merge them by hand).

Usage: ``python tools/relayout_clients.py [ROOT]`` (ROOT: the checkout, default the one this file is in);
``--check``: say what would move and exit 1 if anything would, changing nothing.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

# tools/relayout_machine.py, whose declarations and tools/relayout.py's movers and rewriters this script runs: beside
# it, on the path as `python tools/relayout_clients.py` runs (sys.path[0] is tools/).
import relayout_machine as M

R = M.R

# Modules of forward/ with one client (old path under resumerge/ -> new path under resumerge/).
MOVES: tuple[tuple[str, str], ...] = (
    ("forward/models.py", "analyses/check/models.py"),
    ("forward/ahead.py", "analyses/importance/ahead.py"),
    ("forward/layercache.py", "runs/evolve/layercache.py"),
)
SKIP_FILES = frozenset({*M.SKIP_FILES, "tools/relayout_clients.py", "tests/test_relayout_clients.py"})


def moves() -> list[R.Move]:
    return [R.Move(old, new) for old, new in MOVES]


def relayout(root: Path, dry: bool = False) -> list[str]:
    todo = moves()
    return R.run_moves(root, todo, dry, skip=SKIP_FILES,
                       after=(partial(M.drop_from_all, done=todo), M.rewrite_declarations))


if __name__ == "__main__":
    sys.exit(R.main(run=relayout, doc=__doc__, name="relayout_clients"))

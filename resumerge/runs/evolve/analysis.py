"""``evolve`` as a row of the analyses table (:mod:`resumerge.config.analyses`): a search's STORAGE recognised by its
search file, its status read from STORAGE's files alone (:mod:`.status`: no torch, no model opened), so that
``resumerge status STORAGE`` and :func:`resumerge.api.status` reach a search through the table as they reach a
measurement or a check."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.runs.evolve.status import SearchStatus


class SearchAnalysis:
    """``resumerge evolve``'s STORAGE."""

    def holds(self, out: str | os.PathLike[str], state: StateDir) -> bool:
        from resumerge.runs.evolve.storage import is_storage

        return not os.fspath(out).startswith("hf://") and is_storage(Path(out))

    def status(self, out: str | os.PathLike[str], state: StateDir) -> SearchStatus:
        from resumerge.runs.evolve.status import search_status

        return search_status(Path(out))

    def journal(self, state: StateDir) -> Path:
        # A search journals its candidates and passes in STORAGE; under the state dir it keeps its kl tasks' texts'
        # tokens, in the folder eval keeps them (evolve.vocabs), and its parents' small files.
        return state.evals_dir

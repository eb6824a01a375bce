"""The API's calls that only read what a run recorded: ``status``, ``recipe_status``, ``verify`` and
``evolve_status``, and the one rule on every OUT given (:func:`named`).

The package imports this module at once and every other call on its first use (``resumerge status`` under 0.2 s,
issue 72): a module here imports nothing at its top but the standard library and ``errors``, and each call imports
what it reads inside (no option groups, no kind of run, no torch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.api.keywords import one_spelling
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.api.options import PathLike, Settings
    from resumerge.config.locations import StateDir
    from resumerge.merge.store.integrity import VerifyReport
    from resumerge.merge.store.statusview import StatusReport
    from resumerge.runs.evolve.status import SearchStatus
    from resumerge.runs.recipes.view import RecipeStatus


def named(out: PathLike) -> None:
    """Refuse an empty OUT (``run cfg.yml ""``): as a path it would be the current directory, never what was meant."""
    if not os.fspath(out).strip():
        raise UsageError("OUT is empty", hint="name an output directory, or a hub repo hf://NAMESPACE/NAME")


def _state_of(settings: Settings | None, function: str) -> StateDir:
    """The state dir of a reading call's ``settings`` (None: the default): of them it honours the ``state_dir`` alone,
    the rest refused set (UsageError). The option groups are imported only where a caller gave settings."""
    from resumerge.config.locations import StateDir

    if settings is None:
        return StateDir.resolve(None)
    from resumerge.api.options import taken

    taken(settings, function)
    return StateDir.resolve(settings.state_dir)


@one_spelling
def status(out: PathLike, settings: Settings | None = None) -> StatusReport | RecipeStatus | SearchStatus:
    """Where the merge into ``out`` stands, like ``resumerge status --json``: a :class:`StatusReport`, or for a
    recipe's OUT a :class:`~resumerge.runs.recipes.view.RecipeStatus` (every stage, and the one in progress); an
    analysis's own folder answers through the analyses table (:mod:`resumerge.api.analyses`): a search's STORAGE
    with a :class:`~resumerge.runs.evolve.status.SearchStatus`, as :func:`evolve_status` gives it."""
    from resumerge.api.analyses import analysis_of, annotated
    from resumerge.api.kinds import killed_account, own_record, recorded_kind
    from resumerge.errors import NothingRecordedError
    from resumerge.merge.store.statusview import read_status

    named(out)
    state = _state_of(settings, "status")  # resolved once, handed down
    where = state.run(out)
    own = own_record(where)
    if own is not None:
        return own.status_own(where)
    try:
        report = read_status(out, state)
    except NothingRecordedError as exc:  # no run into it: an analysis's own folder (a measurement, a model only
        analysis = analysis_of(out, state)  # checked), else a run killed while planning (its kind says what it did)
        if analysis is None:
            raise killed_account(exc, where) from None
        return analysis.status(out, state)
    report = recorded_kind(report.kind, report.recorded_text).status(report, where)
    return annotated(report, out, state)  # what the analyses found of it (its newest check)


@one_spelling
def recipe_status(out: PathLike, settings: Settings | None = None) -> RecipeStatus:
    """Where the recipe writing to ``out`` stands (every stage, and the one in progress); raises LedgerError when
    ``out`` holds no recipe. :func:`status` answers this for a recipe's OUT too."""
    from resumerge.runs.recipes.view import read_recipe_status

    return read_recipe_status(out, _state_of(settings, "recipe_status"))


@one_spelling
def verify(out: PathLike, settings: Settings | None = None) -> VerifyReport:
    """Re-hash ``out``'s committed files, like ``resumerge verify`` (of ``settings`` the ``state_dir`` alone)."""
    from resumerge.merge.store.integrity import verify_output

    named(out)
    return verify_output(out, _state_of(settings, "verify"))


def evolve_status(storage: PathLike) -> SearchStatus:
    """Where the search in ``storage`` stands, like ``resumerge status STORAGE`` (its files read; no torch)."""
    from resumerge.runs.evolve.status import search_status

    return search_status(Path(storage))

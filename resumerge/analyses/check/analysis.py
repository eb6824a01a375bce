"""``check`` as a row of the analyses table (:mod:`resumerge.config.analyses`): a model that was only checked is its
own folder (its newest check's status), a merge it checked gets its newest verdict beside the merge's status and its
section of the model card back after a ``resume``; its journal is the state dir's ``checks``."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.analyses.check.progress import check_status, describe, find_progress

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.store.statusview import StatusReport


def _local(out: str | os.PathLike[str]) -> bool:
    return not os.fspath(out).startswith("hf://")  # a hub model's checks are found by their local path only


class CheckAnalysis:
    """``resumerge check``'s journal of a model."""

    def holds(self, out: str | os.PathLike[str], state: StateDir) -> bool:
        return _local(out) and find_progress(state.checks_dir, out) is not None

    def status(self, out: str | os.PathLike[str], state: StateDir) -> StatusReport:
        from resumerge.merge.store.statusview import recorded

        return recorded(check_status(state.checks_dir, out), f"{out} was never checked here")

    def journal(self, state: StateDir) -> Path:
        return state.checks_dir

    def beside(self, report: StatusReport, out: str | os.PathLike[str], state: StateDir) -> StatusReport:
        """``report`` with the newest check of ``out`` (running: its layer and model; done: its verdict) added:
        a row, and ``check`` in the JSON."""
        from resumerge.merge.store.statusview import Details

        found = find_progress(state.checks_dir, out) if _local(out) else None
        if found is None:
            return report
        details = report.details or Details()
        return replace(report, details=Details(counts=details.counts,
                                               rows=(*details.rows, ("check", describe(found))),
                                               data={**details.data, "check": found}))

    def kept(self, outcome: Outcome, state: StateDir) -> Outcome:
        """The last check's section written back into the model card where the resume rebuilt the card without
        it (:func:`~resumerge.analyses.check.card.restore_section`); a hub OUT's card is the repo's (a check makes
        no commit to it)."""
        if outcome.target is None:
            from resumerge.analyses.check.card import restore_section

            restore_section(outcome.out_dir, state)
        return outcome

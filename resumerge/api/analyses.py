"""Every analysis, made from the one table of them (:data:`resumerge.config.analyses.ANALYSES`, which names each
analysis's class) and walked by the API beside the kinds of run (:data:`resumerge.api.kinds.KINDS`): a new analysis
is its package, its command module and one row there. The walk sits in the API's package, above every analysis's own:
``evolve``'s search scores its candidates with the other analyses' code, so the analyses cannot import it.

An analysis (:class:`Analysis`) recognises a folder that is its own (a measurement's OUT_DIR, a model that was only
checked), says where it stands for ``resumerge status``, and names what it journals under the state dir. What only
some analyses do is a small protocol of its own, so that none has a slot it must refuse: one that adds to the
status of a run it analysed, and keeps what it wrote into that run's OUT across a ``resume``, is
:class:`Annotates` (``check``: its newest verdict beside the merge's status, its section of the model card). A
search's status is its own record (:class:`~resumerge.runs.evolve.status.SearchStatus`), shown and printed as JSON as a
run's is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from resumerge.config import analyses as table
from resumerge.config.passplace import named

if TYPE_CHECKING:
    from resumerge.config.locations import StateDir
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.store.statusview import StatusReport
    from resumerge.runs.evolve.status import SearchStatus

PathLike = str | os.PathLike[str]


class Analysis(Protocol):
    """What every analysis does (see the module docstring); its row names it."""

    def holds(self, out: PathLike, state: StateDir) -> bool:
        """Whether ``out`` is this analysis's own folder (reads its listing and small files only)."""

    def status(self, out: PathLike, state: StateDir) -> StatusReport | SearchStatus:
        """Where the analysis in ``out`` (which it :meth:`holds`) stands, as ``resumerge status`` shows a run."""

    def journal(self, state: StateDir) -> Path:
        """The folder under the state dir where this analysis journals its passes (one folder each)."""


@runtime_checkable
class Annotates(Protocol):
    """An analysis that adds to a run it analysed."""

    def beside(self, report: StatusReport, out: PathLike, state: StateDir) -> StatusReport:
        """``report`` (a run's status) with what this analysis found of ``out`` added."""

    def kept(self, outcome: Outcome, state: StateDir) -> Outcome:
        """``outcome`` of a resumed run, with what this analysis wrote into its OUT put back."""


def analyses() -> tuple[Analysis, ...]:
    """Every analysis of the table that keeps a folder of its own, in its order (each class imported on first use)."""
    return tuple(named(row.analysis)() for row in table.ANALYSES if row.analysis is not None)


def analysis_of(out: PathLike, state: StateDir) -> Analysis | None:
    """The analysis whose own folder ``out`` is, or None."""
    return next((a for a in analyses() if a.holds(out, state)), None)


def annotated(report: StatusReport, out: PathLike, state: StateDir) -> StatusReport:
    """A run's ``report`` with what every analysis that :class:`Annotates` found of ``out`` added."""
    for analysis in analyses():
        if isinstance(analysis, Annotates):
            report = analysis.beside(report, out, state)
    return report


def kept(outcome: Outcome, state: StateDir) -> Outcome:
    """A resumed run's ``outcome`` with what every analysis that :class:`Annotates` wrote into its OUT put back."""
    for analysis in analyses():
        if isinstance(analysis, Annotates):
            outcome = analysis.kept(outcome, state)
    return outcome

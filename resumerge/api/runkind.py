"""What a kind of run is: one object that recognises its config, checks it, runs it and estimates it, and owns
what it leaves behind: how its recorded run is resumed, and what its status adds.

A kind of run is one class listed once in :data:`resumerge.api.kinds.KINDS`: every kind is a :class:`RunKind`;
what only some kinds do is a small protocol of its own, so that no kind has a slot it must refuse. A kind that
has a single plan is :class:`Plans`; a run recorded in one ledger (every kind but a recipe) is :class:`Journaled`:
its ledger names its kind, and the API asks that kind to resume it and to say what its status adds; a run that
keeps a record of its own (a recipe: its stages) is :class:`KeepsItsRecord`. Every kind ends in the engine's one
session path (:func:`resumerge.merge.engine.session.run_plan`) with a :class:`~resumerge.merge.plan.prepared.Prepared`,
and its plan records what the model card needs, so ``outputs/`` and ``store/`` never ask which kind they hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

# How a run is driven: the engine's record, which every kind hands on whole.

if TYPE_CHECKING:
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.analyses.estimate.measuring import Measuring
    from resumerge.config.locations import RunLocations
    from resumerge.config.settings import RunSettings
    from resumerge.inputs.codecs import CodecTable
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executor import Reporter
    from resumerge.merge.engine.reporting import Driving
    from resumerge.merge.engine.session import Recorded
    from resumerge.merge.plan.merge_plan import Plan, PlanOptions
    from resumerge.merge.plan.prepared import Phase, Prepared
    from resumerge.merge.store.statusview import StatusReport
    from resumerge.runs.recipes.estimate import RecipeEstimate
    from resumerge.runs.recipes.view import RecipeStatus

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class Call:
    """What one call of the API asked, whatever the kind of run: the ``config`` as given (its file name starts
    errors), its ``text``, OUT (None: an estimate without one), the ``options`` that change the output's bytes and
    the ``settings`` that do not, the one kind-specific flag of the front door (``allow_same_experts``, which
    only MoE upcycling accepts), and ``where`` OUT's run keeps its state, resolved once by the API (None without
    OUT): every kind hands it down rather than deriving it again from the state dir."""

    config: PathLike
    text: str
    out: PathLike | None
    options: PlanOptions
    settings: RunSettings
    allow_same_experts: bool = False
    # The stored formats a merge recognises (None: every one resumerge decodes, CODECS); a notebook hands in a
    # table that lists its own format beside them.
    codecs: CodecTable | None = None
    where: RunLocations | None = None

    @property
    def locations(self) -> RunLocations:
        """``where``, for a call that has OUT (a run)."""
        assert self.where is not None, "a run's call has OUT"
        return self.where


class RunKind(Protocol):
    """What every kind of run does (see the module docstring)."""

    name: str  # what its ledger records (``merge``, ``moe``, ...); never renamed once released

    def recognises(self, text: str) -> bool:
        """Whether ``text`` (a config, or a run's recorded text) is this kind's."""

    def check(self, call: Call, driving: Driving) -> None:
        """Refuse, before any work, what this kind does not accept (options of another kind, an OUT it must not
        write to); raises ConfigError for an invalid config, naming the YAML path."""

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Plan and run ``call`` into its OUT, journaled; the final outcome."""

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate | RecipeEstimate:
        """What running ``call`` would cost here, and whether it fits."""


@runtime_checkable
class Plans(Protocol):
    """A kind with one plan (a recipe has one per stage)."""

    def plan(self, call: Call) -> Plan:
        """The frozen plan of ``call`` (headers only; writes nothing)."""


@runtime_checkable
class Journaled(Protocol):
    """A kind whose run is one journaled run: its ledger records the kind, and the API hands that kind what the
    run recorded."""

    def resume(self, recorded: Recorded, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the run ``recorded`` (its stored plan, else its recorded text planned again by this kind)."""

    def status(self, report: StatusReport, where: RunLocations) -> StatusReport:
        """``report`` (the ledger's or the manifest's account of the run) with this kind's name and details."""


@runtime_checkable
class PlansLong(Protocol):
    """A kind whose planning does work of its own before the plan is recorded (MoE upcycling's prompt forward pass),
    kept for the next run when one is killed while planning; its planning mark names it (the kind is never guessed
    from what the state dir holds)."""

    def planning_done(self, where: RunLocations) -> str:
        """What a run of this kind into ``where.out``, killed while planning, had done that running it again
        continues from: a clause the hint of "killed while planning" ends with ("" when nothing)."""


@runtime_checkable
class KeepsItsRecord(Protocol):
    """A kind whose run keeps a record of its own (a recipe's: its stages), read instead of a single run's
    ledger."""

    def holds(self, where: RunLocations) -> bool:
        """Whether ``where.out`` holds (or is being written by) a run of this kind."""

    def resume_own(self, where: RunLocations, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the run of this kind that ``where.out`` holds."""

    def status_own(self, where: RunLocations) -> RecipeStatus:
        """Where the run of this kind that ``where.out`` holds stands."""


# Plans a single run's recorded text again (its kind's own planner), from the recorded options and model
# directories, under the resume's settings and reporter.
Replanner = Callable[["Recorded", "RunSettings", "Reporter | None"], "Prepared"]


def resume_journaled(name: str, recorded: Recorded, settings: RunSettings, driving: Driving,
                     replan: Replanner, phases: tuple[Phase, ...] = (),
                     settle: Callable[[Plan], Prepared | None] | None = None) -> Outcome:
    """Finish the single run ``recorded`` of the kind ``name``: its stored plan, else ``replan`` of its text; its
    ``phases`` before the merge first (each continued from its own journal), then ``settle`` of the plan."""
    from resumerge.merge.engine.session import finish

    prepared = recorded.stored or replan(recorded, settings, driving.reporter)
    # Recorded under its kind again should the ledger be rebuilt (a damaged one set aside, or a lost state dir).
    return finish(recorded, replace(prepared, kind=name, phases=phases, settle=settle), settings,
                  reporter=driving.reporter, should_stop=driving.should_stop)

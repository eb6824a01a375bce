"""What a kind of run is: one object that recognises its config, checks it, plans it, estimates it, runs it,
resumes it (planning its recorded text again), says where its OUT stands and cleans up after it.

A kind of run is one class implementing :class:`RunKind`, listed once in :data:`resumerge.api.kinds.KINDS`; the API
walks that tuple (:func:`resumerge.api.kinds.kind_of`) and never asks which kind it holds. Every kind ends in the
engine's one session path (:func:`resumerge.engine.session.run_plan`) with a :class:`~resumerge.plan.prepared.Prepared`,
and its plan records what the model card and ``status`` need, so ``outputs/`` and ``store/`` never ask either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from resumerge.config.settings import RunSettings

if TYPE_CHECKING:
    from resumerge.engine.costs import Estimate
    from resumerge.engine.drive import Outcome
    from resumerge.engine.estimate import Measuring
    from resumerge.engine.executor import Reporter
    from resumerge.engine.session import RecordedPlanner
    from resumerge.plan.merge_plan import Plan, PlanOptions
    from resumerge.plan.prepared import Prepared
    from resumerge.recipes.estimate import RecipeEstimate
    from resumerge.recipes.view import RecipeStatus
    from resumerge.store.statusview import StatusReport

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class Call:
    """What one call of the API asked, whatever the kind of run: the ``config`` as given (its file name starts
    errors), its ``text``, OUT (None: an estimate without one), the ``options`` that change the output's bytes and
    the ``settings`` that do not, and the one kind-specific flag of the front door (``allow_same_experts``, which
    only MoE upcycling accepts)."""

    config: PathLike
    text: str
    out: PathLike | None
    options: PlanOptions
    settings: RunSettings
    allow_same_experts: bool = False


@dataclass(frozen=True)
class Driving:
    """How a run is driven: ``restart`` an earlier different run in OUT, show progress on ``reporter``, stop once
    ``should_stop`` turns true; a recipe's ``intermediate_dir`` and ``cleanup`` of its intermediates."""

    should_stop: Callable[[], bool]
    reporter: Reporter | None = None
    restart: bool = False
    intermediate_dir: PathLike | None = None
    cleanup: bool = False


class RunKind(Protocol):
    """One kind of run (see the module docstring). Methods that do not apply to a kind refuse with
    :class:`~resumerge.errors.UsageError`."""

    def recognises(self, text: str) -> bool:
        """Whether ``text`` (a config, or a run's recorded text) is this kind's."""

    def check(self, call: Call, driving: Driving) -> None:
        """Refuse, before any work, what this kind does not accept (options of another kind, an OUT it must not
        write to); raises ConfigError for an invalid config, naming the YAML path."""

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Plan and run ``call`` into its OUT, journaled; the final outcome."""

    def resume(self, out: PathLike, settings: RunSettings, driving: Driving,
               recorded: RecordedPlanner) -> Outcome | None:
        """Finish the run of this kind recorded for ``out`` (None: ``out`` holds no run that this kind resumes);
        ``recorded`` plans a recorded run's text again, by its kind."""

    def prepare_recorded(self, text: str, options: PlanOptions, model_dirs: Mapping[str, str],
                         settings: RunSettings, reporter: Reporter | None, out: PathLike) -> Prepared:
        """The prepared plan of the run recorded as ``text`` in ``out``, for its resume."""

    def plan(self, call: Call) -> Plan:
        """The frozen plan of ``call`` (headers only; writes nothing)."""

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate | RecipeEstimate:
        """What running ``call`` would cost here, and whether it fits."""

    def status(self, out: PathLike, state_dir: PathLike | None) -> StatusReport | RecipeStatus | None:
        """Where this kind's run into ``out`` stands, or None when ``out`` holds no run of this kind."""

    def finished(self, outcome: Outcome, out: PathLike, state_dir: PathLike | None) -> None:
        """Clean up after ``outcome`` when it is this kind's (nothing to do for most kinds)."""

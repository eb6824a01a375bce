"""The shape a LoRA extraction (:mod:`.extraction_kind`) and a tokenizer transplant (:mod:`.surgery_kind`) share: a
kind of run whose recorded text (a spec, options) is planned again on resume into one output, its costly work (an
extraction's factors, a transplant's approximated batches) kept in the run's state folder until the output is
committed (a resumed run redoes only what is not kept), then deleted. Each kind is a subclass saying its name, its
text, its planner, its kept work and what ``status`` shows of it."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.api.merge_kind import refuse_same_experts, single_output
from resumerge.api.runkind import Call, PathLike, resume_journaled

if TYPE_CHECKING:
    from collections.abc import Callable

    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.analyses.estimate.measuring import Measuring
    from resumerge.config.locations import RunLocations, StateDir
    from resumerge.config.settings import RunSettings
    from resumerge.inputs.hub import HubEvent
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executor import Reporter
    from resumerge.merge.engine.reporting import Driving
    from resumerge.merge.engine.session import Recorded
    from resumerge.merge.plan.merge_plan import Plan, PlanOptions
    from resumerge.merge.plan.prepared import Prepared
    from resumerge.merge.store.statusview import Details, StatusReport


class KeptWorkKind(ABC):
    """A kind of run with its work kept until its output is committed (see the module)."""

    name: str
    # The key of this kind's recorded text: a JSON document holding it (a merge's config is YAML).
    mark: str
    # The command that starts a run of this kind, before OUT (what a run killed while planning is told to run
    # again: :func:`~resumerge.api.kinds.killed_account`).
    started_by: str

    def recognises(self, text: str) -> bool:
        """Whether ``text`` is this kind's recorded text: a JSON object holding :attr:`mark`."""
        if not text.lstrip().startswith("{"):
            return False
        try:
            doc = json.loads(text)
        except ValueError:
            return False
        return isinstance(doc, dict) and self.mark in doc

    @abstractmethod
    def prepared(self, text: str, options: PlanOptions, settings: RunSettings, *, out: PathLike | None,
                 model_dirs: Mapping[str, str] | None, on_progress: Callable[[HubEvent], None] | None) -> Prepared:
        """The plan of ``text`` and its opened inputs, the finished work read from ``out``'s run folder (None: an
        estimate, nothing kept)."""

    @abstractmethod
    def clear(self, out: PathLike, state: StateDir) -> None:
        """Discard the work kept for ``out`` (a restart: it belongs to the run replaced)."""

    @abstractmethod
    def forget(self, outcome: Outcome, out: PathLike, state: StateDir) -> None:
        """Delete the work kept for ``out`` once ``outcome`` is committed: nobody needs it any more."""

    @abstractmethod
    def details(self, report: StatusReport, where: RunLocations) -> Details | None:
        """What ``status`` shows of the kept work besides the ledger's account (None: nothing)."""

    def check(self, call: Call, driving: Driving) -> None:
        """Refuse MoE's and recipes' options, and a run into a recipe's OUT."""
        refuse_same_experts(call)
        single_output(call, driving)

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Plan and run ``call`` (``restart`` also discards the work kept by the run it replaces), then delete the
        kept work."""
        from resumerge.machine.planning import planning_mark
        from resumerge.merge.engine.session import run_plan
        from resumerge.merge.engine.target import Target

        assert call.out is not None
        if driving.restart:
            self.clear(call.out, call.settings.state)
        # The mark names this kind: status says "planning" while the models are matched, and a run killed then is
        # told as one of this kind, with its own command (killed_account).
        with planning_mark(call.locations.run_dir, kind=self.name):
            target = Target.at(call.locations, call.settings)
            prepared = self._prepare(call.text, call.options, call.settings, out=call.out,
                                     reporter=driving.reporter)
            outcome = run_plan(prepared, call.text, target, call.settings, restart=driving.restart,
                               reporter=driving.reporter, should_stop=driving.should_stop)
        self.forget(outcome, call.out, call.settings.state)
        return outcome

    def resume(self, recorded: Recorded, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the run ``recorded`` (its finished work read from its run folder), then delete the kept work, as
        :meth:`run` does."""
        outcome = resume_journaled(self.name, recorded, settings, driving, self._replan)
        self.forget(outcome, recorded.target.locations.out, settings.state)
        return outcome

    def plan(self, call: Call) -> Plan:
        """The plan of ``call``."""
        return self._prepare(call.text, call.options, call.settings).plan

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate:
        """The estimate, as a merge's (nothing kept)."""
        from resumerge.analyses.estimate.estimate import estimate_config
        from resumerge.api.options import usable_device

        usable_device(call.options.device)
        return estimate_config(call.text, call.options, call.settings, source=self.name, out_dir=call.out,
                               measuring=measuring, fresh_process=fresh_process,
                               planner=lambda: self._prepare(call.text, call.options, call.settings))

    def status(self, report: StatusReport, where: RunLocations) -> StatusReport:
        """The ledger's account, with this kind's :meth:`details`."""
        return replace(report, kind=self.name, details=self.details(report, where))

    def _replan(self, recorded: Recorded, settings: RunSettings, reporter: Reporter | None) -> Prepared:
        """The recorded text planned again, its finished work read from OUT's run folder."""
        return self._prepare(recorded.text, recorded.options, settings, out=recorded.target.locations.out,
                             model_dirs=recorded.model_dirs, reporter=reporter)

    def _prepare(self, text: str, options: PlanOptions, settings: RunSettings, *, out: PathLike | None = None,
                 model_dirs: Mapping[str, str] | None = None, reporter: Reporter | None = None) -> Prepared:
        from resumerge.merge.engine.drive import hub_progress

        return replace(self.prepared(text, options, settings, out=out, model_dirs=model_dirs,
                                     on_progress=hub_progress(reporter)), kind=self.name)

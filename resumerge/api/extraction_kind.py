"""A LoRA extraction: a fine-tune's adapter against its base (:func:`resumerge.api.extract_lora`), planned by
:mod:`resumerge.runs.extract`; its recorded text is the extraction's spec, which a resume plans again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.api.merge_kind import refuse_same_experts, single_output
from resumerge.api.runkind import Call, Driving, PathLike, resume_journaled
from resumerge.runs.extract.state import is_extraction_text

if TYPE_CHECKING:
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.analyses.estimate.estimate import Measuring
    from resumerge.config.locations import RunLocations, StateDir
    from resumerge.config.settings import RunSettings
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executor import Reporter
    from resumerge.merge.engine.session import Recorded
    from resumerge.merge.plan.merge_plan import Plan, PlanOptions
    from resumerge.merge.plan.prepared import Prepared
    from resumerge.merge.store.statusview import Details, StatusReport


class ExtractionKind:
    """A LoRA extraction. Each module's factors are kept in the run's state folder until the adapter is
    committed (a resumed run decomposes only the modules not finished), then deleted."""

    name = "extraction"

    def recognises(self, text: str) -> bool:
        """An extraction's spec (:func:`~resumerge.runs.extract.spec.spec_text`)."""
        return is_extraction_text(text)

    def check(self, call: Call, driving: Driving) -> None:
        """Refuse MoE's and recipes' options, and an extraction into a recipe's OUT."""
        refuse_same_experts(call)
        single_output(call, driving)

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Plan and run the extraction (``restart`` also discards the cached factors of the run it replaces)."""
        from resumerge.merge.engine.session import run_plan
        from resumerge.merge.engine.target import Target

        assert call.out is not None
        if driving.restart:
            from resumerge.runs.extract.prepare import clear_factors

            clear_factors(call.out, call.settings.state)
        target = Target.at(call.locations, call.settings)
        prepared = _prepare(call.text, call.options, call.settings, out=call.out, reporter=driving.reporter)
        outcome = run_plan(prepared, call.text, target, call.settings, restart=driving.restart,
                           reporter=driving.reporter, should_stop=driving.should_stop)
        _forget_factors(outcome, call.out, call.settings.state)
        return outcome

    def resume(self, recorded: Recorded, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the extraction ``recorded`` (its finished modules' factors read from its run folder), then
        delete the factors, as :meth:`run` does."""
        outcome = resume_journaled(self.name, recorded, settings, driving, _replan)
        _forget_factors(outcome, recorded.target.locations.out, settings.state)
        return outcome

    def plan(self, call: Call) -> Plan:
        """The extraction's plan (``--sv-epsilon`` reads the weights to count each module's rank)."""
        return _prepare(call.text, call.options, call.settings).plan

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate:
        """The extraction's estimate, as a merge's (no factor is kept)."""
        from resumerge.analyses.estimate.estimate import estimate_config
        from resumerge.api.options import usable_device

        usable_device(call.options.device)
        return estimate_config(call.text, call.options, call.settings, source="extraction", out_dir=call.out,
                               measuring=measuring, fresh_process=fresh_process,
                               planner=lambda: _prepare(call.text, call.options, call.settings))

    def status(self, report: StatusReport, where: RunLocations) -> StatusReport:
        """The ledger's account, with the adapter's modules: its one file moves only at the end, the modules
        one by one."""
        modules = _module_progress(report, where) if report.source == "ledger" else None
        return replace(report, kind=self.name, details=modules)


def _module_progress(report: StatusReport, where: RunLocations) -> Details | None:
    """The adapter's modules, from this kind's own plan (each module's factor A): every one done once the adapter
    is committed; before that, those whose factors are in the run's factor cache, and the one decomposed now
    (running) or next (interrupted)."""
    from resumerge.merge.store.ledger_read import tensor_names
    from resumerge.merge.store.statusview import Details
    from resumerge.runs.extract.state import FACTORS_DIR, cached_modules, lora_modules

    names = tensor_names(where.ledger)
    modules = lora_modules(names)
    if not modules:
        return None
    total = len(modules)
    if report.tensors_done and report.tensors_done == len(names):
        return Details(counts=(("modules", total, total, "decomposed"),),
                       data={"modules_total": total, "modules_done": total})
    cached = cached_modules(where.run_dir / FACTORS_DIR)
    pending = [m for m in modules if m not in cached]
    current = pending[0] if pending else None
    label = "decomposing" if report.state == "running" else "next module"
    return Details(counts=(("modules", total - len(pending), total, "decomposed"),),
                   rows=((label, current),) if current is not None else (),
                   data={"modules_total": total, "modules_done": total - len(pending), "module_current": current})


def _forget_factors(outcome: Outcome, out: PathLike, state: StateDir) -> None:
    """After an extraction's adapter is committed nobody needs its modules' cached factors: delete them."""
    from resumerge.runs.extract.prepare import forget_factors

    forget_factors(outcome.plan, out, state)


def _replan(recorded: Recorded, settings: RunSettings, reporter: Reporter | None) -> Prepared:
    """The recorded spec planned again, its finished modules' factors read from OUT's run folder."""
    return _prepare(recorded.text, recorded.options, settings, out=recorded.target.locations.out,
                    model_dirs=recorded.model_dirs, reporter=reporter)


def _prepare(text: str, options: PlanOptions, settings: RunSettings, *, out: PathLike | None = None,
             model_dirs: Mapping[str, str] | None = None, reporter: Reporter | None = None) -> Prepared:
    """The plan of the extraction recorded as ``text`` and its opened inputs; its finished modules' factors are
    kept in ``out``'s run folder (None: an estimate, nothing kept)."""
    from resumerge.merge.engine.drive import hub_progress
    from resumerge.runs.extract.prepare import prepare_extraction

    return replace(prepare_extraction(text, options, settings, out=out, model_dirs=model_dirs,
                                      on_progress=hub_progress(reporter)), kind=ExtractionKind.name)

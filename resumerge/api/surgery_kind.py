"""A tokenizer transplant (:func:`resumerge.api.tokensurgeon`): MODEL's weights with DONOR's vocabulary, planned by
:mod:`resumerge.runs.transplant`; its recorded text is the transplant's options, which a resume plans again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.api.merge_kind import refuse_same_experts, single_output
from resumerge.api.runkind import Call, Driving, PathLike, resume_journaled
from resumerge.runs.transplant.spec import is_surgery_text

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
    from resumerge.runs.transplant.batches import BatchStore


class SurgeryKind:
    """A transplant. Each approximated batch of tokens is kept in the run's state folder until the run is done
    (a resumed run computes only the batches not finished), then deleted."""

    name = "tokensurgeon"

    def recognises(self, text: str) -> bool:
        """A transplant's options (:func:`~resumerge.runs.transplant.spec.spec_text`)."""
        return is_surgery_text(text)

    def check(self, call: Call, driving: Driving) -> None:
        """Refuse MoE's and recipes' options, and a transplant into a recipe's OUT."""
        refuse_same_experts(call)
        single_output(call, driving)

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Plan and run the transplant (``restart`` also discards the kept batches of the run it replaces)."""
        from resumerge.merge.engine.session import run_plan
        from resumerge.merge.engine.target import Target

        assert call.out is not None
        if driving.restart:
            _store(call.out, call.settings.state).clear()
        target = Target.at(call.locations, call.settings)
        prepared = _prepare(call.text, call.options, call.settings, out=call.out, reporter=driving.reporter)
        outcome = run_plan(prepared, call.text, target, call.settings, restart=driving.restart,
                           reporter=driving.reporter, should_stop=driving.should_stop)
        _forget(outcome, call.out, call.settings.state)
        return outcome

    def resume(self, recorded: Recorded, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the transplant ``recorded`` (its finished batches read from its run folder), then delete them."""
        outcome = resume_journaled(self.name, recorded, settings, driving, _replan)
        _forget(outcome, recorded.target.locations.out, settings.state)
        return outcome

    def plan(self, call: Call) -> Plan:
        """The transplant's plan (reads the two tokenizers, no weight)."""
        return _prepare(call.text, call.options, call.settings).plan

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate:
        """The transplant's estimate, as a merge's."""
        from resumerge.analyses.estimate.estimate import estimate_config
        from resumerge.api.options import usable_device

        usable_device(call.options.device)
        return estimate_config(call.text, call.options, call.settings, source="tokensurgeon", out_dir=call.out,
                               measuring=measuring, fresh_process=fresh_process,
                               planner=lambda: _prepare(call.text, call.options, call.settings))

    def status(self, report: StatusReport, where: RunLocations) -> StatusReport:
        """The ledger's account, with the approximated batches kept so far while the matrices are computed."""
        return replace(report, kind=self.name, details=_batches(report, where))


def _batches(report: StatusReport, where: RunLocations) -> Details | None:
    from resumerge.merge.store.statusview import Details
    from resumerge.runs.transplant.batches import BATCHES_DIR, SUFFIX

    directory = where.run_dir / BATCHES_DIR
    try:
        kept = sum(1 for _ in directory.glob("*" + SUFFIX))
    except OSError:
        kept = 0
    if report.state == "done" or not kept:
        return None
    return Details(rows=(("batches approximated", str(kept)),), data={"batches_done": kept})


def _store(out: PathLike, state: StateDir) -> BatchStore:
    from resumerge.runs.transplant.prepare import batch_store

    return batch_store(out, state)


def _forget(outcome: Outcome, out: PathLike, state: StateDir) -> None:
    """After the output is committed nobody needs the kept batches: delete them."""
    from resumerge.runs.transplant.prepare import batch_store

    if outcome.plan.method == "tokensurgeon":
        batch_store(out, state).clear()


def _replan(recorded: Recorded, settings: RunSettings, reporter: Reporter | None) -> Prepared:
    """The recorded transplant planned again, its finished batches read from OUT's run folder."""
    return _prepare(recorded.text, recorded.options, settings, out=recorded.target.locations.out,
                    model_dirs=recorded.model_dirs, reporter=reporter)


def _prepare(text: str, options: PlanOptions, settings: RunSettings, *, out: PathLike | None = None,
             model_dirs: Mapping[str, str] | None = None, reporter: Reporter | None = None) -> Prepared:
    from resumerge.merge.engine.drive import hub_progress
    from resumerge.runs.transplant.prepare import prepare_surgery

    prepared = prepare_surgery(text, options, settings, out=out, model_dirs=model_dirs,
                               on_progress=hub_progress(reporter))
    _give_back()
    return replace(prepared, kind=SurgeryKind.name)


def _give_back() -> None:
    """Collect the two tokenizers the planning let go and hand the heap's free pages back to the OS
    (``malloc_trim``) before the units run. A 262,144-token tokenizer's Python vocabulary and transformers' objects
    take ~370 MB while the match is made; freed, glibc kept ~160 MB of it in the heap for the rest of the run, under
    the approximation's peak (Gemma-3-270M ← SmolLM2: 590 MB resident after the match, 432 MB trimmed)."""
    import gc

    from resumerge.memory.allocator import malloc_trim

    gc.collect()
    trim = malloc_trim()
    if trim is not None:
        trim(0)

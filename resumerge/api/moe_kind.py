"""MoE upcycling: a mergekit-moe config (``base_model`` and ``experts``), planned by :mod:`resumerge.runs.moe`; the
hidden-state gate modes' prompt forward pass runs in a process of its own, started before the run plans, or with
its layers where the run's executor places a forward pass (``--executor ray``: an actor on a node)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.api.merge_kind import single_output
from resumerge.api.runkind import Call, PathLike, resume_journaled

if TYPE_CHECKING:
    from pathlib import Path

    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.analyses.estimate.measuring import Measuring
    from resumerge.config.locations import RunLocations
    from resumerge.config.settings import RunSettings
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executor import Reporter
    from resumerge.merge.engine.reporting import Driving
    from resumerge.merge.engine.session import Recorded
    from resumerge.merge.plan.merge_plan import Plan, PlanOptions
    from resumerge.merge.plan.prepared import Prepared
    from resumerge.merge.store.statusview import Details, StatusReport
    from resumerge.runs.moe import MoeConfig
    from resumerge.runs.moe.gatesites import StartsGates
    from resumerge.runs.moe.passproc import PassProcess

# A decoder layer's tensors: the layer count of this kind's own plan, from its tensors' names.
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MoeKind:
    """MoE upcycling, as ``mergekit-moe`` does it."""

    name = "moe"

    def recognises(self, text: str) -> bool:
        """A mergekit-moe config: one YAML mapping with ``experts`` and no ``merge_method``."""
        from resumerge.runs.moe import is_moe_text

        return is_moe_text(text)

    def check(self, call: Call, driving: Driving) -> None:
        """The config checked (ConfigError naming the YAML path), recipes' options refused, and a recipe's OUT."""
        _config(call)
        single_output(call, driving)

    def run(self, call: Call, driving: Driving) -> Outcome:
        """Plan and run it, the prompt forward pass (in a process started first, loading while this one plans)
        beside the merge where the budget holds both; nothing is read before the config and OUT are checked."""
        from resumerge.machine.planning import planning_mark
        from resumerge.merge.engine.session import run_plan
        from resumerge.merge.engine.target import Target
        from resumerge.runs.moe.passdone import routers_finished
        from resumerge.runs.moe.passproc import started_early

        assert call.out is not None
        config = _config(call)
        # The mark names this kind: a run killed during its prompt pass is told as one (planning_done). A run that
        # continues one past its pass starts no process for it: the planner finds its routers.
        with started_early(config.gate_mode, call.settings.state,
                           lambda: routers_finished(config, call.locations)) as early, \
                planning_mark(call.locations.run_dir, kind=self.name):
            target = Target.at(call.locations, call.settings)
            prepared = _prepare(config, call.options, call.settings, driving.reporter, early=early,
                                out=target.out if target.hub is None else None)
            return run_plan(prepared, call.text, target, call.settings, restart=driving.restart,
                            reporter=driving.reporter, should_stop=driving.should_stop)

    def resume(self, recorded: Recorded, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the upcycling ``recorded``: its stored plan, else its config planned again; its experts may all
        be one model: that was allowed when the run started (the rule is about intent)."""
        return resume_journaled(self.name, recorded, settings, driving, _replan)

    def plan(self, call: Call) -> Plan:
        """The plan, without computing the hidden-state routers."""
        from resumerge.runs.moe.prepare import prepare_moe

        return prepare_moe(_config(call), call.options, call.settings, forward=False).plan

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate:
        """Planned without its prompt forward pass: the estimate counts the pass, it does not run it."""
        from resumerge.analyses.estimate.estimate import estimate_config
        from resumerge.analyses.estimate.measuring import PassMakers
        from resumerge.api.options import source_name
        from resumerge.runs.moe.passcost import estimators

        source = source_name(call.config, "config")
        planner, prepass = estimators(_config(call), call.options, call.settings)
        return estimate_config(call.text, call.options, call.settings, source=source, out_dir=call.out,
                               measuring=measuring, fresh_process=fresh_process, planner=planner,
                               passes=PassMakers(prepass=prepass))

    def planning_done(self, where: RunLocations) -> str:
        """The decoder layers the prompt forward pass under way had finished, which running it again continues
        after."""
        from resumerge.runs.moe.state import passes_under_way

        under_way = passes_under_way(where.root)
        return (f"; its prompt forward pass continues after the {under_way[0]} decoder layers it finished"
                if len(under_way) == 1 and under_way[0] else "")

    def status(self, report: StatusReport, where: RunLocations) -> StatusReport:
        """The ledger's account, with the prompt forward pass while one is under way (the routers' shard waits
        for it)."""
        pass_line = _pass_progress(where) if report.source == "ledger" and report.state != "done" else None
        return replace(report, kind=self.name, details=pass_line)


def _pass_progress(where: RunLocations) -> Details | None:
    """The decoder layers done by the one prompt forward pass under way in the state dir (None when none is, or
    several are: which one is this run's is not recorded)."""
    from resumerge.merge.store.ledger_read import tensor_names
    from resumerge.merge.store.statusview import Details
    from resumerge.runs.moe.state import passes_under_way

    under_way = passes_under_way(where.root)
    if len(under_way) != 1:
        return None
    layers = {int(m.group(1)) for n in tensor_names(where.ledger) if (m := _LAYER.match(n))}
    if not layers:
        return None
    done, total = under_way[0], max(layers) + 1
    return Details(rows=(("pass", f"prompt forward pass: {done} of {total} decoder layers (the routers' shard "
                                  "waits for it)"),), data={"prepass_layers": [done, total]})


def _replan(recorded: Recorded, settings: RunSettings, reporter: Reporter | None) -> Prepared:
    from resumerge.runs.moe import load_moe_text

    return _prepare(load_moe_text(recorded.text, allow_all_same=True), recorded.options, settings, reporter,
                    recorded.model_dirs)


def _config(call: Call) -> MoeConfig:
    """The loaded config; raises ConfigError naming the YAML path before any model is opened."""
    from resumerge.api.options import source_name
    from resumerge.runs.moe import load_moe_text

    return load_moe_text(call.text, allow_all_same=call.allow_same_experts,
                         source=source_name(call.config, "config"))


def _prepare(config: MoeConfig, options: PlanOptions, settings: RunSettings, reporter: Reporter | None,
             model_dirs: Mapping[str, str] | None = None, *, early: PassProcess | None = None,
             out: Path | None = None) -> Prepared:
    """The planner (:mod:`resumerge.runs.moe`), which starts the hidden-state modes' prompt pass: beside the merge in
    ``early``, the process the caller started (and stops), where the budget allows; else it is done here."""
    from resumerge.merge.engine.drive import hub_progress
    from resumerge.runs.moe.gatesites import Starting
    from resumerge.runs.moe.prepare import prepare_moe

    return replace(prepare_moe(config, options, settings, model_dirs=model_dirs, on_progress=hub_progress(reporter),
                               out=out, starting=Starting(_site(settings), early is not None, early)),
                   kind=MoeKind.name)


def _site(settings: RunSettings) -> StartsGates:
    """Where the gates' pass runs: where the run's executor places a forward pass (as it places a check's): in the
    prompt work's own process, on this machine, or the base's layers where the executor's site places them (an
    actor of the Ray cluster), this process driving the pass."""
    from resumerge.api.options import pass_placement
    from resumerge.forward.placing.sites import site_of
    from resumerge.runs.moe.gatesites import IN_ITS_PROCESS, PlacedBy

    state = settings.state
    given = None if state.given is None else str(state.root)  # --state-dir, as a node opens it
    places = site_of(pass_placement(settings)).places(given, "prompt forward pass")
    return IN_ITS_PROCESS if places is None else PlacedBy(places)

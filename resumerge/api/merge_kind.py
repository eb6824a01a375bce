"""A single merge: one mergekit YAML document (``merge_method`` and its models), planned by
:mod:`resumerge.merge.plan` through the engine's session."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.api.runkind import Call, PathLike, resume_journaled
from resumerge.errors import UsageError

if TYPE_CHECKING:
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
    from resumerge.merge.store.statusview import StatusReport


class MergeKind:
    """A single merge: any config no other kind recognises (the merge config loader reports what is wrong)."""

    name = "merge"

    def recognises(self, text: str) -> bool:
        """Always: the last kind walked."""
        return True

    def check(self, call: Call, driving: Driving) -> None:
        """Refuse text that is not YAML (ConfigError naming the config and line, as plan words it, before anything
        starts), MoE's and recipes' options, and a single merge into a recipe's OUT."""
        from resumerge.config.merge_config import parse_documents

        parse_documents(call.text, source=_source(call))
        refuse_same_experts(call)
        single_output(call, driving)

    def run(self, call: Call, driving: Driving) -> Outcome:
        """The merge through :func:`~resumerge.merge.engine.session.run_merge`; with ``--imatrix-texts``, its
        importance pass a phase before the merge (recorded with the plan: a kill in it is resumed)."""
        from resumerge.api.importance import importance_phases, recorded_choice, target_settle
        from resumerge.machine.torch_import import load_beside
        from resumerge.merge.engine.session import run_merge

        # A size target's run already settled in OUT (killed in its encoding): the same command continues it.
        options = recorded_choice(call.options, call.text, call.locations.ledger)
        phases = importance_phases(call.text, options, call.settings, command=call.locations.resume_command)
        note = numpy_encoders_note(options)
        if note is not None and driving.reporter is not None:
            driving.reporter.message(note)
        # The pass's forward imports torch (~1 CPU s): imported while the merge plans, not after it.
        importing = load_beside() if phases else None
        try:
            return run_merge(call.text, call.locations, options, call.settings, driving, codecs=call.codecs,
                             phases=phases,
                             settle=target_settle(call.text, options, call.settings))
        finally:
            if importing is not None:  # a run refused while planning never leaves torch half imported
                importing.join()

    def resume(self, recorded: Recorded, settings: RunSettings, driving: Driving) -> Outcome:
        """Finish the merge ``recorded``: its stored plan, else its config planned again, its models where the
        run found them; with ``--imatrix-texts``, its importance pass first (found computed, or resumed from its
        journal), unless the texts changed since (the plan then differs: refused as such, before any pass)."""
        from resumerge.api.importance import computed_imatrix, importance_phases, target_settle

        # The matrix's place in this state dir (the record names none: it is no part of what the run writes).
        _same_files(recorded)
        recorded = replace(recorded, options=computed_imatrix(recorded.options, recorded.text, settings.state))
        phases = importance_phases(recorded.text, recorded.options, settings, model_dirs=recorded.model_dirs,
                                   command=f"resumerge resume {recorded.target.out}")
        return resume_journaled(self.name, recorded, settings, driving, _replan, phases,
                                target_settle(recorded.text, recorded.options, settings, recorded.model_dirs))

    def plan(self, call: Call) -> Plan:
        """The merge config's plan (headers only)."""
        from resumerge.config.merge_config import load_config_text
        from resumerge.merge.engine.session import plan_from_config

        refuse_same_experts(call)
        return plan_from_config(load_config_text(call.text, source=_source(call)), call.options, codecs=call.codecs,
                                state=call.settings.state)

    def estimate(self, call: Call, measuring: Measuring, *, fresh_process: bool,
                 intermediate_dir: PathLike | None) -> Estimate:
        """The merge's estimate (:func:`~resumerge.analyses.estimate.estimate.estimate_config`)."""
        from resumerge.analyses.estimate.estimate import estimate_config
        from resumerge.analyses.estimate.measuring import PassMakers
        from resumerge.api.importance import importance_cost, measures_costs

        refuse_same_experts(call)
        texts = call.options.imatrix_texts  # its pass before the merge counted in
        return estimate_config(call.text, call.options, call.settings, source=_source(call), out_dir=call.out,
                               measuring=measuring, fresh_process=fresh_process,
                               passes=PassMakers(first_pass=importance_cost(
                                   texts, measuring=measures_costs(call.options)) if texts is not None else None))

    def status(self, report: StatusReport, where: RunLocations) -> StatusReport:
        """The ledger's (or the manifest's) account, all a merge's status has."""
        return replace(report, kind=self.name)


def _same_files(recorded: Recorded) -> None:
    """Refuse (exit 4) the resume of a run whose ``--imatrix`` or ``--imatrix-texts`` file is not where this
    machine's ledger found it (or OUT's manifest alone holds the run, which names no machine's path: the file must
    be given again), holds other bytes than when the run started (its importance matrix, so its output, would
    differ; a plan stored with the run is reused without planning again, so it is asked here), or was recorded by
    its path alone (a run started before the digests were: its plan is not today's)."""
    from resumerge.api.ggufoptions import file_sha256
    from resumerge.errors import PlanChangedError
    from resumerge.merge.plan.merge_plan import PATH_OPTIONS

    options, out = recorded.options, recorded.target.out
    for name in PATH_OPTIONS:
        where = getattr(options, name)
        if where is None or (name == "imatrix" and options.imatrix_texts is not None):  # none, or computed here
            continue
        digest, flag, shown = getattr(options, f"{name}_sha256"), f"--{name.replace('_', '-')}", Path(where).name
        if digest is None:
            raise PlanChangedError(f"{flag} {where}: the run was recorded by an earlier resumerge, by the file's "
                                   "path and not its bytes; its plan is not today's", path=str(where),
                                   hint="start over with resumerge run CONFIG OUT --restart")
        if not Path(where).is_absolute() or not Path(where).is_file():
            said = f"is gone from {where}" if Path(where).is_absolute() else "is not recorded on this machine"
            raise PlanChangedError(f"{flag} {shown} (sha256 {digest}): the file the run reads {said}", path=str(where),
                                   hint=f"give it again: resumerge run CONFIG {out} with the run's options and "
                                        f"{flag} FILE (a file of those bytes) continues the run")
        if file_sha256(Path(where)) != digest:
            raise PlanChangedError(f"{flag} {where}: its bytes changed since the run started (then sha256 {digest})",
                                   path=str(where), hint="put the file back as it was to resume, or start over "
                                                         "with resumerge run --restart")


def _replan(recorded: Recorded, settings: RunSettings, reporter: Reporter | None) -> Prepared:
    """The recorded merge config planned again, its models where the run found them."""
    from resumerge.config.merge_config import load_config_text
    from resumerge.merge.engine.session import prepare

    return prepare(load_config_text(recorded.text), recorded.options, model_dirs=recorded.model_dirs,
                   state=settings.state, reporter=reporter)


def single_output(call: Call, driving: Driving) -> None:
    """Refuse recipes' options, and a single run (of any kind but a recipe) into a recipe's OUT."""
    from resumerge.api.options import single_merge_only  # here: status imports the kinds, not the options

    if call.out is not None:
        single_merge_only(call.config, call.out, call.settings, intermediate_dir=driving.intermediate_dir,
                          cleanup_intermediates=driving.cleanup)


def refuse_same_experts(call: Call) -> None:
    """``allow_same_experts`` is MoE upcycling's flag: refused (exit 2) for a config of another kind."""
    if call.allow_same_experts:
        raise UsageError("--i-understand-this-is-not-useful-without-training applies to mergekit-moe configs "
                         f"(base_model and experts) only, and {_source(call)} is not one")


def _source(call: Call) -> str:
    from resumerge.api.options import source_name

    return source_name(call.config, "config")


def numpy_encoders_note(options: PlanOptions) -> str | None:
    """The line a run writing K-quants tells where numba is missing (the ``kquants`` extra): the same bytes, from
    the numpy path, in several times the CPU (``bench/bench_qkx_jit.py`` and ``bench/bench_qx_jit.py`` time each
    searched type's encoder both ways); None otherwise."""
    from resumerge.config.outformats import takes
    from resumerge.merge.plan.gguftypes import MIXES
    from resumerge.outputs.gguf import jit
    from resumerge.outputs.gguf.encoders import SEARCHED

    searched = [k for k in options.gguf_type.split(",") if k in MIXES and MIXES[k].default in SEARCHED]
    if not takes(options.out_type, "gguf_type") or not searched or jit.numba_module() is not None:
        return None
    return (f"{','.join(searched)} is encoded by numpy: numba is not installed here (pip install numba, or the "
            "kquants extra, writes the same bytes in about a third of the CPU)")

"""Run and resume merges: plan a merge config, or find what a resume must finish, then the one session path.

The session path is one path: :func:`run_merge`, a resume (:func:`resuming`, then :func:`finish`) and every stage
of a recipe open OUT with :meth:`~resumerge.merge.engine.target.Target.open` and end in :func:`run_plan`, which drives
the plan (:class:`~resumerge.merge.engine.drive.RunSession`: governors, locks, ledger, execution). A new kind of run is
a planner that produces a :class:`~resumerge.merge.plan.prepared.Prepared`, then that same call; how it is carried out
travels as one :class:`~resumerge.config.settings.RunSettings`. The engine never asks which kind of run it holds:
a resume hands back what was recorded, and the kind the API found recorded plans it again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from resumerge.config.locations import RunLocations, StateDir
from resumerge.config.merge_config import MergeConfig, load_config_text
from resumerge.config.settings import RunSettings
from resumerge.errors import (
    KilledPlanningError,
    LedgerError,
    NothingRecordedError,
    UsageError,
)
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CodecTable
from resumerge.machine.memory.collector import collector_paused
from resumerge.machine.planning import killed_while_planning, planning_mark
from resumerge.merge.engine.drive import Outcome, RunSession, hub_progress
from resumerge.merge.engine.executor import Reporter
from resumerge.merge.engine.frozenplan import thaw
from resumerge.merge.engine.outdir import FILES_READ
from resumerge.merge.engine.quiet import never_stop
from resumerge.merge.engine.reporting import UNDRIVEN, Driving
from resumerge.merge.engine.target import Target
from resumerge.merge.methods.registry import MethodSpec
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.parameters import checked_method
from resumerge.merge.plan.planner import build_plan, threads_matter
from resumerge.merge.plan.prepared import Phase, Prepared
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import MANIFEST_NAME
from resumerge.merge.store.outgone import refuse_gone


def prepare(
    config: MergeConfig,
    options: PlanOptions,
    *,
    model_dirs: Mapping[str, str] | None = None,
    state: StateDir | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    reporter: Reporter | None = None,
    codecs: CodecTable | None = None,
) -> Prepared:
    """Open every referenced model (config.json and headers only) and build the plan; no weight is fetched.
    ``state``: where hub files' verification is recorded (None: for this call only).
    ``codecs``: the stored formats recognised (None: :data:`~resumerge.inputs.codecs.CODECS`)."""
    checked_method(config)  # an unknown method: refused from the YAML, before any model is opened or downloaded
    with collector_paused():  # millions of long-lived objects, few cycles: see resumerge.machine.memory.collector
        inputs = open_inputs(config, model_dirs=model_dirs, state=state, cache_dir=cache_dir,
                             on_progress=hub_progress(reporter))
        if codecs is None:  # the planner's own default table
            return Prepared(build_plan(config, inputs.models, options), inputs)
        return Prepared(build_plan(config, inputs.models, options, codecs), inputs)


def plan_from_config(config: MergeConfig, options: PlanOptions,
                     model_dirs: Mapping[str, str] | None = None, *, codecs: CodecTable | None = None,
                     state: StateDir | None = None) -> Plan:
    """The plan of ``config`` (headers only); raises InputError subclasses for anything that would fail later."""
    return prepare(config, options, model_dirs=model_dirs, codecs=codecs, state=state).plan


def run_merge(
    config_text: str,
    where: RunLocations,
    options: PlanOptions,
    settings: RunSettings,
    driving: Driving = UNDRIVEN,
    *,
    codecs: CodecTable | None = None,
    phases: Sequence[Phase] = (),
    settle: Callable[[Plan], Prepared | None] | None = None,
) -> Outcome:
    """Merge ``config_text`` into ``where.out`` (its locations resolved once, by the caller), driven as ``driving``
    says (its ``restart``, ``reporter`` and ``should_stop``); continue an unfinished run of the same plan there.
    ``phases``: the caller's work the merge's units wait for (the importance
    matrix a GGUF's encoding reads), recorded with the plan and run once it is (:mod:`.phasing`); ``settle``: the
    plan as their results settle it (:func:`~.phasing.settle_plan`).

    Raises InputError (exit 2) before touching OUT; PlanChangedError when OUT holds another run and
    ``restart`` is false; InterruptedMerge when ``should_stop`` turned true; StorageError on write failures.
    OUT may be ``hf://NAMESPACE/NAME[@BRANCH]``: write access is checked (exit 2) before anything else is
    read. ``settings`` (budgets, staging, the hub's commits) are described on :class:`RunSettings`.
    """
    config = load_config_text(config_text)
    checked_method(config)  # before OUT's hub repo is asked
    target = Target.at(where, settings)
    with planning_mark(target.locations.run_dir):  # status says "planning" until the plan is recorded
        # An unreachable hub input: exit 2 or 3 by whether a run is recorded, decided at the front door
        # (resumerge.api.options.nothing_started), the one rule for every kind of run.
        prepared = prepare(config, options, state=settings.state, cache_dir=settings.cache_dir,
                           reporter=driving.reporter, codecs=codecs)
        return run_plan(replace(prepared, phases=tuple(phases), settle=settle), config_text, target, settings,
                        restart=driving.restart, reporter=driving.reporter, should_stop=driving.should_stop)


@dataclass(frozen=True)
class Recorded:
    """What a resume finds recorded for OUT (in the ledger, else in OUT's manifest): the run's recorded ``text``,
    ``options`` and ``model_dirs``, the ``stored`` plan when it is still valid (no input file changed since it
    was recorded; None: the run's kind plans ``text`` again), and the ``kind`` of run the ledger names (None: a
    ledger of the version before kinds were recorded, or OUT's manifest alone)."""

    target: Target
    text: str
    options: PlanOptions
    model_dirs: Mapping[str, str]
    stored: Prepared | None
    kind: str | None


@contextmanager
def resuming(where: RunLocations, settings: RunSettings,
             reporter: Reporter | None = None) -> Iterator[Recorded]:
    """What the run recorded for ``where.out`` (from the ledger, else from OUT's manifest; an ``hf://`` OUT from the
    repo alone when the state dir is gone), while ``status`` says "planning"; the kind of run the API found
    recorded plans it again when needed and finishes it with :func:`finish`.

    Raises LedgerError when neither exists, OutputDirError when OUT moved."""
    target = Target.at(where, settings).read_recorded()
    # Asked before this resume takes the mark: a run killed while planning left it, held by no process.
    killed = killed_while_planning(str(target.out), target.locations.run_dir)
    with planning_mark(target.locations.run_dir):  # status says "planning" until the run goes on
        yield _recorded(target, settings, reporter, killed)


def _recorded(target: Target, settings: RunSettings, reporter: Reporter | None,
              killed: KilledPlanningError | None = None) -> Recorded:
    out, manifest, state = target.out, target.manifest(), settings.state
    ledger_path = target.locations.ledger
    row, stored, read = None, None, {}
    if ledger_path.exists():
        try:
            ledger = Ledger(ledger_path)
        except LedgerError as exc:
            if manifest is None:  # nothing to rebuild it from: refuse rather than guess
                exc.hint = f"OUT has no {MANIFEST_NAME} to rebuild it from; start over with resumerge run --restart"
                raise
            # Damaged but OUT has a manifest: the run sets the ledger aside and rebuilds it from the manifest.
        else:
            row = ledger.run_row()
            stored = ledger.frozen_plan() if row is not None else None
            read = ledger.last_event_data(FILES_READ) or {}
            committed = sum(1 for r in ledger.files() if r.status == "done")
            ledger.close()
            if row is not None and target.hub is None:
                refuse_gone(out, committed, state)
    if row is not None:
        text, opts, dirs = row.config_text, row.options, row.model_dirs
    elif manifest is not None:
        text, opts, dirs = manifest.config_text, dict(manifest.options), dict(manifest.model_dirs)
    elif target.hub is not None:  # nothing anywhere holds the run: only `run` can start it (never "try later")
        url = target.hub.url
        where = "it does not exist on the hub" if not target.hub.exists else f"the repo holds no {MANIFEST_NAME}"
        raise NothingRecordedError(f"nothing to resume in {url}: {where} and the state dir holds no ledger of it",
                                   path=url, hint=f"start it with: resumerge run CONFIG {url} (pass the killed "
                                                  "run's --state-dir if it used one)")
    else:
        if killed is not None:  # the run died planning: say so, and that running it again continues
            raise killed
        if not os.path.lexists(out):  # a path that names nothing: mistyped (exit 2), as status and verify say
            raise NothingRecordedError.of(out)
        raise NothingRecordedError(
            f"nothing to resume in {out}: no ledger in the state dir and no {MANIFEST_NAME}",
            path=str(out),
            hint="start the merge with resumerge run CONFIG OUT (pass --state-dir if you used one)",
        )
    # The plan stored when the run was recorded, while no input file changed since; else planned again (a changed
    # input then gives another fingerprint, which the session refuses).
    thawed = thaw(stored, dirs, row.fingerprint) if row is not None else None
    if thawed is not None and reporter is not None:
        # What the stored plan's key compares (frozenplan._folder): the proof of the files' bytes comes after.
        reporter.message("the plan recorded when the run started is reused: the input folders list the files, sizes "
                         "and modification times they listed then")
    # The files given by path where this machine read them (the ledger's event; the record names them by base name)
    opts = {**opts, **{k: v for k, v in read.items() if opts.get(k) is not None}}
    return Recorded(target, text, PlanOptions(**opts), dirs, Prepared(thawed) if thawed is not None else None,
                    row.kind if row is not None else None)


def finish(recorded: Recorded, prepared: Prepared, settings: RunSettings, *, reporter: Reporter | None = None,
           should_stop: Callable[[], bool] = never_stop) -> Outcome:
    """Finish the run ``recorded``, planned as ``prepared`` (its stored plan, or its kind's plan of it again), with
    ``settings`` (they do not change the output, so they may differ from the first run's).

    Raises PlanChangedError when the inputs or resumerge changed, UsageError when the merge computes on a GPU that
    this machine lacks (the device is part of the output's identity) or asks another thread count than recorded
    where the bytes depend on it."""
    plan = prepared.plan
    settings = recorded_threads(plan.options.num_threads, {t.method for t in plan.tensors.values()}, settings,
                                reporter, plan.units)
    return run_plan(prepared, recorded.text, recorded.target, settings, resuming=True, reporter=reporter,
                    should_stop=should_stop)


def recorded_threads(recorded: int | None, methods: Iterable[str], settings: RunSettings,
                     reporter: Reporter | None, units: Sequence[MethodSpec] = ()) -> RunSettings:
    """The settings a resume computes with: the thread count ``recorded`` with a plan (or a recipe) whose
    ``methods`` (built-in ones or the plan's ``units``) have bytes that depend on it (None when they do not, or the
    run left it to torch), and a different -j refused."""
    asked = settings.num_threads
    if not threads_matter(methods, units) or asked == recorded:
        return settings
    if asked is not None:
        was = f"-j {recorded}" if recorded is not None else "torch's default thread count (no -j)"
        raise UsageError(f"this merge was started with {was}, and its methods' bytes depend on the thread count",
                         hint=f"resume without -j (it reuses {was})")
    if reporter is not None:
        reporter.message(f"using -j {recorded}, as the run was started with (the output's bytes depend on it)")
    return replace(settings, num_threads=recorded)


def run_plan(
    prepared: Prepared,
    config_text: str,
    target: Target,
    settings: RunSettings,
    *,
    restart: bool = False,
    resuming: bool = False,
    reporter: Reporter | None = None,
    should_stop: Callable[[], bool] = never_stop,
) -> Outcome:
    """The session path every kind of run ends in: :meth:`RunSession.run` of ``prepared`` (of ``config_text``)
    into ``target`` under ``settings``. A new kind of run is a planner that makes a :class:`Prepared`, then this
    call. The outcome's ``elapsed_seconds`` is this call's wall time (planning excepted)."""
    from resumerge.merge.engine.phasing import Replanned

    started = time.monotonic()
    try:
        outcome = RunSession(prepared, config_text, target, settings, restart=restart, resuming=resuming,
                             reporter=reporter, should_stop=should_stop).run()
    except Replanned as settled:  # recorded: the run goes on as its resume (its phases find their work done)
        outcome = RunSession(settled.prepared, config_text, target, settings, resuming=True, reporter=reporter,
                             should_stop=should_stop).run()
    return replace(outcome, elapsed_seconds=time.monotonic() - started)

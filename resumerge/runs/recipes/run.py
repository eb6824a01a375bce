"""Run and resume multi-stage recipes: plan every stage, record the recipe, then bring each stage to done.

Order is the safety argument, as for one merge: the whole recipe is parsed and every stage planned (headers only)
before anything is written; every output dir is checked (foreign files, other runs) and every memory budget
before the first byte; then the recipe record goes to the state dir and atomically into OUT, inputs are fetched
once, and the stages run. Each stage is journaled exactly like a single merge (its own ledger, manifest and
lock, through :func:`resumerge.merge.engine.session.run_plan`). A stage counts as done only when its own record says
every planned file is committed *and* the files re-hash to their checksums — never because a config.json and a weight
file exist (mergekit-multi's ``--lazy`` defect) — and a done stage is re-verified only when something still has
to read it. A resume therefore continues mid-stage, repairs a damaged intermediate before a later stage reads
it, and rebuilds intermediates deleted by ``--cleanup-intermediates`` if the final output ever needs repair.

OUT may be a hub repo (``hf://NAMESPACE/NAME[@BRANCH]``): it is opened (write access, creation, foreign files)
before anything else is read, the named stages are written locally as always, only the final stage commits to the
repo (the single-merge sink), and the record is committed to the repo beside it, so a fresh machine resumes from
the repo alone and recomputes the intermediates it lacks (they are deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import RunLocations
from resumerge.config.settings import RunSettings
from resumerge.config.version import __version__
from resumerge.errors import (
    InterruptedMerge,
    NothingRecordedError,
    PlanChangedError,
    ResumergeError,
    StorageError,
    UnreachableError,
)
from resumerge.inputs.catalog import fetch_inputs
from resumerge.machine.durable import is_temp_name
from resumerge.machine.runlock import RunLock
from resumerge.merge.engine.devices import make_governor
from resumerge.merge.engine.drive import Outcome, hub_progress
from resumerge.merge.engine.executor import Reporter
from resumerge.merge.engine.hubout import check_max_disk
from resumerge.merge.engine.outdir import check_out_dir
from resumerge.merge.engine.reporting import UNDRIVEN, Driving
from resumerge.merge.engine.session import recorded_threads, run_plan
from resumerge.merge.engine.target import Target
from resumerge.merge.plan.changes import describe_changes
from resumerge.merge.plan.merge_plan import PlanOptions, fingerprint_parts
from resumerge.merge.plan.outguard import model_places, overlap, refuse_state_in_out
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.sidefiles import aux_files
from resumerge.merge.store.integrity import verify_output
from resumerge.runs.recipes.discard import discard_stage_output, rmdir_if_empty
from resumerge.runs.recipes.hub import RecipeHub, open_recipe_hub
from resumerge.runs.recipes.ledger import open_recipe_ledger
from resumerge.runs.recipes.ledger_read import RECIPE_LEDGER_NAME
from resumerge.runs.recipes.manifest import (
    DELETED,
    DELETING,
    KEPT,
    RECIPE_MANIFEST_NAME,
    RecipeRecord,
    StageEntry,
    located_record,
    read_recipe_ledger,
    read_recipe_record,
    recipe_dir,
    write_recipe_manifest,
)
from resumerge.runs.recipes.plan import (
    RecipePlan,
    StagePlan,
    default_intermediate_dir,
    plan_recipe,
    refuse_streamed_recipe,
)
from resumerge.runs.recipes.recipe import load_recipe_text
from resumerge.runs.recipes.view import StageRecord, stage_record


@dataclass(frozen=True)
class StageOutcome:
    """What happened to one stage: ``merged`` (ran, or continued), ``verified`` (already done and intact) or
    ``deleted`` (an intermediate removed by ``--cleanup-intermediates``)."""

    label: str
    out_dir: Path
    action: str
    resumed_files: int = 0


@dataclass(frozen=True)
class RecipeOutcome:
    """A finished recipe: its plan, the final stage's outcome (OUT), and every stage's."""

    plan: RecipePlan
    final: Outcome
    stages: tuple[StageOutcome, ...]

    def outcome(self) -> Outcome:
        """The final stage's outcome (OUT), saying how many stages the recipe has and how many ran now."""
        merged = sum(1 for s in self.stages if s.action == "merged")
        return replace(self.final, detail=f"{len(self.plan.stages)} stages, {merged} merged in this run")


def run_recipe(
    text: str,
    where: RunLocations,
    options: PlanOptions,
    settings: RunSettings,
    driving: Driving = UNDRIVEN,
    *,
    source: str = "recipe",
) -> RecipeOutcome:
    """Run the recipe ``text`` (several YAML documents) into ``where.out``, its state where ``where`` says (resolved
    once by the caller: every stage's locations are taken beside it), driven as ``driving`` says; continue an
    unfinished run of the same recipe there.

    Named stages go to ``driving.intermediate_dir/<name>`` (default: ``OUT.intermediates`` beside OUT, or the one the
    recorded run used). ``cleanup`` deletes them once the final output is verified. Raises ConfigError /
    InputError (exit 2) before anything is written; PlanChangedError when OUT holds a recipe planned
    differently and ``restart`` is false (naming the stage that changed); OutputDirError for foreign files or
    another process; InterruptedMerge / StorageError (exit 3) when stopped: ``resume_recipe`` continues.

    OUT may be ``hf://NAMESPACE/NAME[@BRANCH]`` (then the named stages default to the state dir);
    ``settings`` mean what they mean for :func:`resumerge.merge.engine.session.run_merge`, except that
    ``settings.max_disk`` bounds the final stage's staged files, not the intermediates.
    """
    refuse_streamed_recipe(options)
    recipe = load_recipe_text(text, source=source)
    hub = open_recipe_hub(where, settings.output) if is_hub_target(where.out) else None
    out: str | Path = hub.url if hub else Path(where.out).absolute()
    if isinstance(out, Path):
        refuse_state_in_out(out, where.state)
    previous = _recorded(out, where, hub)
    if driving.intermediate_dir is not None:
        inter = Path(driving.intermediate_dir).absolute()
    elif previous is not None and not driving.restart:
        previous, inter = _recorded_intermediates(previous, out, where)
    else:
        inter = default_intermediate_dir(out, where.state)
    # An unreachable hub input: exit 2 or 3 by whether a run is recorded, decided at the front door
    # (resumerge.api.options.nothing_started), the one rule for every kind of run.
    rplan = plan_recipe(recipe, out, inter, options, state=where.state, cache_dir=settings.cache_dir,
                        on_progress=hub_progress(driving.reporter))
    runner = _Runner(rplan, previous, settings, hub, where, restart=driving.restart, resuming=False,
                     cleanup=driving.cleanup)
    return runner.run(driving.reporter, driving.should_stop)


def resume_recipe(where: RunLocations, settings: RunSettings, driving: Driving = UNDRIVEN) -> RecipeOutcome:
    """Finish the recipe recorded for ``where.out`` (recipe ledger, else ``OUT/resumerge-recipe.json``), with the
    recorded text, options, intermediate dir and pinned inputs, driven as ``driving`` says (its ``restart`` and
    ``intermediate_dir`` aside: a resume continues the recorded run, where it recorded its stages). An ``hf://``
    OUT resumes from the repo alone when the state dir is gone: the intermediates are recomputed (in the recorded
    intermediate dir, or under this state dir when that one is gone too) and the final stage continues without
    sending committed files again.

    Raises LedgerError when no recipe is recorded, PlanChangedError (exit 4, naming the stage) when an input or
    resumerge itself changed since the recipe was planned.
    """
    hub = open_recipe_hub(where, settings.output, create=False) if is_hub_target(where.out) else None
    out: str | Path = hub.url if hub else Path(where.out).absolute()
    previous = _recorded(out, where, hub)
    if previous is None:
        raise NothingRecordedError(
            f"nothing to resume in {out}: no recipe ledger in the state dir and no {RECIPE_MANIFEST_NAME}",
            path=str(out),
            hint="start it with resumerge run RECIPE OUT (pass --state-dir if you used one)",
        )
    recipe = load_recipe_text(previous.recipe_text)
    previous, inter = _recorded_intermediates(previous, out, where)
    rplan = plan_recipe(recipe, out, inter, PlanOptions(**previous.options),
                        model_dirs=previous.model_dirs, state=where.state, on_progress=hub_progress(driving.reporter))
    # The stages compute with the -j the recipe was started with where their bytes depend on it, as a merge does.
    settings = recorded_threads(rplan.options.num_threads,
                                {t.method for sp in rplan.stages for t in sp.plan.tensors.values()}, settings,
                                driving.reporter)
    runner = _Runner(rplan, previous, settings, hub, where, restart=False, resuming=True, cleanup=driving.cleanup)
    return runner.run(driving.reporter, driving.should_stop)


class _Runner:
    """One pass over a planned recipe: check, record, fetch, settle every stage, finish, clean up. ``where`` is
    the recipe's locations, resolved once: each stage's are taken beside them, and its command resumes them all."""

    def __init__(self, rplan: RecipePlan, previous: RecipeRecord | None, settings: RunSettings,
                 hub: RecipeHub | None, where: RunLocations, *, restart: bool, resuming: bool, cleanup: bool) -> None:
        self.rplan, self.previous, self.settings = rplan, previous, settings
        self.hub, self.where, self.command = hub, where, where.resume_command
        self.reporter: Reporter | None = None
        self.should_stop: Callable[[], bool] = lambda: False
        self.restart, self.resuming = restart, resuming
        same = previous is not None and previous.fingerprint == rplan.fingerprint
        self.cleanup = cleanup or (same and previous is not None and previous.cleanup)
        self.record = _record_of(rplan, self.cleanup, previous.intermediates if same and previous else KEPT)
        self.settled: dict[str, StageOutcome] = {}
        self.final_outcome: Outcome | None = None

    def run(self, reporter: Reporter | None, should_stop: Callable[[], bool]) -> RecipeOutcome:
        self.reporter, self.should_stop = reporter, should_stop
        self._refuse_changes()
        self._check_outputs()
        rdir = recipe_dir(self.where.beside(self.rplan.out))
        lock = RunLock(rdir, self.rplan.out, lock_out=False)
        lock.acquire()
        try:
            # Downloads first, as for one merge: an interruption there leaves nothing in OUT, and a process
            # killed after the record is written never reads a hub header a second time.
            fetch_inputs(self.rplan.inputs, state=self.where.state,
                         on_progress=hub_progress(self.reporter))
            self.ledger = open_recipe_ledger(rdir / RECIPE_LEDGER_NAME)
            try:
                return self._run_stages()
            finally:
                self.ledger.close()
        finally:
            lock.release()

    def _run_stages(self) -> RecipeOutcome:
        self._discard_stale()
        self._start()
        try:
            for root in self.rplan.recipe.roots:
                self._settle(self.rplan.of(root))
            self._store(replace(self.record, state="done"))
            self.ledger.set_state("done")
            if self.cleanup:
                self._clean_intermediates()
        except (InterruptedMerge, StorageError, UnreachableError, KeyboardInterrupt) as exc:
            self.ledger.set_state("interrupted", error=_one_line(exc))
            raise
        except BaseException as exc:
            self.ledger.set_state("failed", error=_one_line(exc))
            raise
        assert self.final_outcome is not None
        order = [self.settled[sp.stage.key] for sp in self.rplan.stages if sp.stage.key in self.settled]
        return RecipeOutcome(self.rplan, self.final_outcome, tuple(order))

    # -- before anything is written -----------------------------------------------------------------------
    def _refuse_changes(self) -> None:
        if self.previous is None or self.restart:
            return
        changes = recipe_changes(self.previous, self.rplan)
        if changes:
            raise PlanChangedError(
                f"{self.rplan.out} holds a recipe planned differently: {'; '.join(changes)}",
                path=str(self.rplan.out),
                hint="restore the recipe's inputs as they were, or start over with resumerge run RECIPE OUT --restart"
                if self.resuming
                else "resume it unchanged (resumerge resume OUT), use another OUT, or pass --restart to start over",
            )

    def _check_outputs(self) -> None:
        """Refuse foreign output dirs, stage dirs holding other runs, and budgets too small for any stage."""
        from resumerge.merge.engine.devices import gpu_governor

        for sp in self.rplan.stages:
            where = self.rplan.out_of(sp)
            if isinstance(where, Path):  # a repo OUT was checked when it was opened
                refuse_state_in_out(where, self.settings.state,
                                    what="OUT" if sp.final else f"the output of {sp.stage.label}")
                check_out_dir(where, tolerate=_tolerated(sp))
            else:
                check_max_disk(sp.plan, self.settings.max_disk)
            own = self._stage_record(sp)
            if own is not None and own.fingerprint != sp.plan.fingerprint and not self.restart:
                what = "; ".join(describe_changes(own.parts, own.inputs, sp.plan)) or "the plan changed"
                raise PlanChangedError(
                    f"{where} holds a merge planned differently from {sp.stage.label}: {what}",
                    path=str(where),
                    hint="use another --intermediate-dir or OUT, or pass --restart to start over",
                )
            make_governor(sp.plan, self.settings.max_memory)
            gpu_governor(sp.plan, sp.plan.options.device, self.settings.max_gpu_memory)

    # -- recording -----------------------------------------------------------------------------------------
    def _start(self) -> None:
        hub = self.hub
        if hub is None:
            out = self.rplan.out_dir
            out.mkdir(parents=True, exist_ok=True)
            for entry in out.iterdir():
                if is_temp_name(entry.name, {RECIPE_MANIFEST_NAME}) and entry.is_file():
                    entry.unlink()
        self.ledger.start(str(self.rplan.out), self.record)
        self._publish(self.record)

    def _store(self, record: RecipeRecord) -> None:
        self.record = record
        self.ledger.update_record(record)
        self._publish(record)

    def _publish(self, record: RecipeRecord) -> None:
        """Put the record into OUT: atomically into the folder, or as a commit to the repo (only when it changed:
        the final stage's own commits never carry it, so a repo's record is always whole)."""
        if self.hub is not None:
            self.hub.store(record)
        else:
            write_recipe_manifest(self.rplan.out_dir, record)

    def _discard_stale(self) -> None:
        """With --restart: delete the outputs of stages the new recipe no longer has (only their files)."""
        if self.previous is None or not self.restart:
            return
        current = {str(sp.out_dir) for sp in self.rplan.stages}
        for entry in self.previous.stages:
            # a repo's record names its stages by no folder of this machine (published_record): nothing here to delete
            if entry.out_dir not in current and not entry.final and Path(entry.out_dir).is_absolute():
                if overlap(entry.out_dir, model_places(self.rplan.inputs.models)) is not None:
                    # The new recipe reads it by its path: an input now, never deleted.
                    self.ledger.event("restart", f"kept the output of the dropped {entry.label}: the recipe reads it")
                    continue
                discard_stage_output(Path(entry.out_dir), (), self.where.beside(entry.out_dir))
                self.ledger.event("restart", f"deleted the output of the dropped {entry.label}")

    # -- running -------------------------------------------------------------------------------------------
    def _settle(self, sp: StagePlan) -> None:
        """Make ``sp``'s output complete and intact: verify it if it is done, else settle what it reads and run it."""
        key = sp.stage.key
        if key in self.settled:
            return
        if self._intact(sp):
            return
        for producer in self.rplan.producers(sp):
            self._settle(producer)
        if self.should_stop():
            raise InterruptedMerge("recipe stopped between stages; every finished stage is kept",
                                   resume_command=self.command)
        if not sp.final and self.record.intermediates != KEPT:
            self._store(replace(self.record, intermediates=KEPT))  # the final output needs them again
        self._drive(sp)

    def _intact(self, sp: StagePlan) -> bool:
        where = self.rplan.out_of(sp)
        own = self._stage_record(sp)
        if own is None or own.fingerprint != sp.plan.fingerprint or not own.complete:
            return False
        report = verify_output(where, self.where.state)
        if not report.ok or report.pending:
            return False
        self.settled[sp.stage.key] = StageOutcome(sp.stage.label, sp.out_dir, "verified", report.checked)
        self._message(f"{sp.stage.label}: done, {report.checked} files verified ({where})")
        if sp.final:
            target = where if isinstance(where, str) else None
            self.final_outcome = Outcome(sp.plan, sp.out_dir, report.checked, ("verified",), target=target)
        self.ledger.stage_state(sp.stage.key, "done")
        return True

    def _stage_record(self, sp: StagePlan) -> StageRecord | None:
        # The repo's manifest was read when it was opened, and nothing has written the final stage since.
        hub = self.hub
        remote = hub.output.manifest if hub is not None and sp.final else None
        return stage_record(self.rplan.out_of(sp), self.where.state, repo_manifest=remote)

    def _drive(self, sp: StagePlan) -> None:
        key = sp.stage.key
        position = 1 + [s.stage.key for s in self.rplan.stages].index(key)
        where = self.rplan.out_of(sp)
        self._message(f"{sp.stage.label} ({position}/{len(self.rplan.stages)}): merging into {where}")
        self.ledger.stage_state(key, "running")
        # Every stage goes through the single-merge session path; the final one of a repo OUT writes to the repo.
        if self.hub is not None and sp.final:
            target = Target.of_hub(self.hub.final_output(), self.where.beside(self.hub.url), self.command)
        else:
            out = Path(sp.out_dir).absolute()
            target = Target(out, self.command, self.where.beside(out), tolerate=_tolerated(sp))
        try:
            prepared, text = self._prepared(sp)
            outcome = run_plan(prepared, text, target, self.settings, restart=self.restart,
                               resuming=self.resuming, reporter=self.reporter, should_stop=self.should_stop)
        except (InterruptedMerge, StorageError, UnreachableError, KeyboardInterrupt) as exc:
            self.ledger.stage_state(key, "interrupted", error=_one_line(exc))
            raise
        except BaseException as exc:
            self.ledger.stage_state(key, "failed", error=_one_line(exc))
            raise
        finally:
            _close_display(self.reporter)
        if sp.stage.surgery is not None:  # its output is committed: nobody needs the kept batches
            from resumerge.runs.transplant.prepare import batch_store

            batch_store(self._batches_of(sp), self.settings.state).clear()
        self.ledger.stage_state(key, "done")
        self.settled[key] = StageOutcome(sp.stage.label, sp.out_dir, "merged", outcome.resumed_files)
        if sp.final:
            self.final_outcome = outcome

    def _prepared(self, sp: StagePlan) -> tuple[Prepared, str]:
        """The stage's planned run and its recorded text: a merge's plan and YAML, or a transplant's plan with its
        run's matches (its batches kept in the stage's run folder) and its options' JSON."""
        if sp.stage.surgery is None:
            return Prepared(sp.plan), sp.stage.text
        from resumerge.runs.transplant.prepare import planned_surgery

        found = planned_surgery(sp.stage.surgery, self.rplan.options, self.settings.state, self.settings.cache_dir,
                                out=self._batches_of(sp), model_dirs=self.rplan.model_dirs)
        if found.plan.fingerprint != sp.plan.fingerprint:
            raise ResumergeError(f"internal: {sp.stage.label} planned differently when it ran")
        return replace(found, inputs=None), sp.stage.surgery

    def _batches_of(self, sp: StagePlan) -> str | Path:
        """Where the transplant of ``sp`` keeps its batches: the run folder of its output."""
        return self.hub.url if self.hub is not None and sp.final else Path(sp.out_dir).absolute()

    def _clean_intermediates(self) -> None:
        """Delete every named stage's output now that the final output is verified; recorded before and after,
        so an interrupted clean-up is finished by the next resume and status never trusts half-deleted stages."""
        if self.record.intermediates == DELETED:
            return
        self._store(replace(self.record, intermediates=DELETING))
        for sp in self.rplan.stages:
            if sp.final:
                continue
            names = [s.name for s in sp.plan.shards] + [a.name for a in aux_files(sp.plan)]
            removed = discard_stage_output(sp.out_dir, names, self.where.beside(sp.out_dir))
            self.settled[sp.stage.key] = StageOutcome(sp.stage.label, sp.out_dir, "deleted", removed)
            self.ledger.stage_state(sp.stage.key, "deleted")
        rmdir_if_empty(self.rplan.intermediate_dir)
        self._store(replace(self.record, intermediates=DELETED))
        self._message(f"intermediate stage outputs deleted from {self.rplan.intermediate_dir}")

    def _message(self, text: str) -> None:
        if self.reporter is not None:
            self.reporter.message(text)


def recipe_changes(previous: RecipeRecord, rplan: RecipePlan) -> list[str]:
    """Sentences for what differs between the recorded recipe and ``rplan``, the first changed stage first
    (with what changed in it); empty when they agree."""
    changes = []
    # a repo's record names no machine's folder (published_record): where its stages go is this machine's choice
    if Path(previous.intermediate_dir).is_absolute() and previous.intermediate_dir != str(rplan.intermediate_dir):
        changes.append(f"the intermediate dir changed ({previous.intermediate_dir} -> {rplan.intermediate_dir})")
    before = {s.key: s for s in previous.stages}
    now = {sp.stage.key: sp for sp in rplan.stages}
    gone = [before[k].label for k in before if k not in now]
    new = [now[k].stage.label for k in now if k not in before]
    if gone:
        changes.append(f"{', '.join(gone)} removed")
    if new:
        changes.append(f"{', '.join(new)} added")
    changed: list[str] = []
    for sp in rplan.stages:
        old = before.get(sp.stage.key)
        if old is None or old.fingerprint == sp.plan.fingerprint:
            continue
        if not changed:
            what = describe_changes(old.parts, old.inputs, sp.plan) or ["its plan changed"]
            changes.append(f"{sp.stage.label} changed: {', '.join(what)}")
        changed.append(sp.stage.label)
    if len(changed) > 1:
        changes.append(f"so did {', '.join(changed[1:])}, which read it")
    if not changes and previous.fingerprint != rplan.fingerprint:
        changes.append("the recipe's stages changed")
    return changes


def _recorded(out: str | Path, where: RunLocations, hub: RecipeHub | None = None) -> RecipeRecord | None:
    """The recipe recorded for ``out`` (``where``'s): the recipe ledger in the state dir, else OUT's record (a
    repo's, read when the repo was opened)."""
    if hub is not None:
        found = read_recipe_ledger(recipe_dir(where.beside(hub.url)) / RECIPE_LEDGER_NAME)
        return found[0] if found is not None else hub.record
    recorded = read_recipe_record(out, where.state)
    return recorded[0] if recorded is not None else None


def _recorded_intermediates(previous: RecipeRecord, out: str | Path,
                            where: RunLocations) -> tuple[RecipeRecord, Path]:
    """The record and the intermediate dir a continued run uses: the recorded one. A repo OUT resumed on a fresh
    machine whose recorded default dir (under the first machine's state dir) is gone uses this state dir's default
    instead: nothing there was kept, the stages are recomputed, and their place is not part of any plan."""
    recorded = Path(previous.intermediate_dir)
    if not isinstance(out, str) or (recorded.is_absolute() and recorded.exists()):
        return previous, recorded
    here = default_intermediate_dir(out, where.state)
    if not recorded.is_absolute():  # the repo's record names no folder of any machine (published_record)
        return located_record(previous, out, here), here
    if here == recorded or here.name != recorded.name:
        return previous, recorded
    return replace(previous, intermediate_dir=str(here)), here


def _record_of(rplan: RecipePlan, cleanup: bool, intermediates: str) -> RecipeRecord:
    stages = tuple(
        StageEntry(sp.stage.key, sp.stage.name, sp.stage.document, str(rplan.out_of(sp)), sp.plan.fingerprint,
                   sp.final, fingerprint_parts(sp.plan), {k: [list(f) for f in v] for k, v in sp.plan.inputs.items()})
        for sp in rplan.stages
    )
    return RecipeRecord(__version__, rplan.fingerprint, rplan.recipe.text, str(rplan.intermediate_dir),
                        asdict(rplan.options), rplan.model_dirs, cleanup, stages, "running", intermediates)


def _tolerated(sp: StagePlan) -> frozenset[str]:
    return frozenset({RECIPE_MANIFEST_NAME}) if sp.final else frozenset()


def _close_display(reporter: Reporter | None) -> None:
    # Each stage starts its own progress display; a live one must stop before the next can start.
    close = getattr(reporter, "close", None)
    if callable(close):
        close()


def _one_line(exc: BaseException) -> str:
    return exc.one_line() if isinstance(exc, ResumergeError) else f"{type(exc).__name__}: {exc}"

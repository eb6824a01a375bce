"""Run and resume merges: validate, plan, take the locks, reconcile OUT with the ledger, execute, finish.

Order matters and is the safety argument: nothing touches OUT until the config, every input header and the
plan are valid; a non-empty OUT without resumerge's manifest is refused; the ledger records the plan and the
manifest is written before the first shard; the state becomes ``done`` only after the final manifest.

The session path is one path: :func:`run_merge`, :func:`resume_merge` and every stage of a recipe open OUT with
:meth:`~resumerge.engine.target.Target.open` and end in :func:`run_plan`, which builds the governors and drives
the plan. A new kind of run is a planner that produces a :class:`~resumerge.plan.merge_plan.Plan`, then that same
call; how it is carried out travels as one :class:`~resumerge.engine.settings.RunSettings`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge import torch_import
from resumerge.config.locations import run_dir
from resumerge.config.merge_config import MergeConfig, load_config_text
from resumerge.engine.devices import gpu_governor
from resumerge.engine.executor import Reporter, Stopped, execute
from resumerge.engine.hubout import HubOutput, create_recorded
from resumerge.engine.inputfetch import HubInputs
from resumerge.engine.outdir import open_run, planned_files, refuse_changed_plan
from resumerge.engine.reconcile import reconcile
from resumerge.engine.settings import RunSettings
from resumerge.engine.target import Target
from resumerge.engine.traffic import TrafficMeter, watch_run
from resumerge.errors import (
    InputError,
    InterruptedMerge,
    LedgerError,
    OutputDirError,
    ResumergeError,
    StorageError,
    UnreachableError,
    UnreachableInputError,
    UsageError,
)
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.model import InputWatch
from resumerge.inputs.source import InputSources
from resumerge.memory import CudaProbe, MemoryGovernor, SystemProbe, default_budget, format_size, os_peak_rss
from resumerge.methods.registry import MethodSpec
from resumerge.plan.merge_plan import Plan, PlanOptions
from resumerge.plan.planner import build_plan, threads_matter
from resumerge.plan.prepared import Prepared
from resumerge.plan.workunits import largest, oversized_units
from resumerge.store.durable import is_temp_name
from resumerge.store.filesystems import Staging, filesystem_type, staging_dir
from resumerge.store.ledger import LEDGER_NAME, Ledger, set_aside
from resumerge.store.manifest import MANIFEST_NAME, Manifest
from resumerge.store.sink import LocalDirSink, OutputSink, StagedDirSink
from resumerge.store.statusview import resume_command

if TYPE_CHECKING:
    from resumerge.inputs.hub import HubEvent


def _never() -> bool:
    return False


# Plans a run's recorded config text of another kind than a merge config (MoE upcycling's), from the recorded
# options and model directories, under the resume's settings and reporter; None when the text is a merge config.
RecordedPlanner = Callable[[str, PlanOptions, Mapping[str, str], RunSettings, "Reporter | None"],
                           "Prepared | None"]


class NullReporter:
    """A reporter that shows nothing (library use, ``--quiet``)."""

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        """Ignore."""

    def tensor_done(self, name: str, nbytes: int) -> None:
        """Ignore."""

    def file_done(self, name: str, kind: str) -> None:
        """Ignore."""

    def message(self, text: str) -> None:
        """Ignore."""

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None:
        """Ignore."""

    def memory_budget(self, nbytes: int) -> None:
        """Ignore."""


@dataclass(frozen=True)
class Outcome:
    """What a finished run did: the plan, what was already committed, and notes for the user."""

    plan: Plan
    out_dir: Path
    resumed_files: int
    notes: tuple[str, ...] = field(default=())
    target: str | None = None  # the hf:// repo when OUT is one (then out_dir is only its name)
    detail: str | None = None  # what else the run did, for its "done" line (a recipe: its stages)


def prepare(
    config: MergeConfig,
    options: PlanOptions,
    *,
    model_dirs: Mapping[str, str] | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    reporter: Reporter | None = None,
) -> Prepared:
    """Open every referenced model (config.json and headers only) and build the plan; no weight is fetched."""
    inputs = open_inputs(config, model_dirs=model_dirs, state_dir=state_dir, cache_dir=cache_dir,
                         on_progress=hub_progress(reporter))
    return Prepared(build_plan(config, inputs.models, options), inputs)


def plan_from_config(config: MergeConfig, options: PlanOptions,
                     model_dirs: Mapping[str, str] | None = None) -> Plan:
    """The plan of ``config`` (headers only); raises InputError subclasses for anything that would fail later."""
    return prepare(config, options, model_dirs=model_dirs).plan


def hub_progress(reporter: Reporter | None, meter: TrafficMeter | None = None) -> Callable[[HubEvent], None] | None:
    """The hub progress callback: the end of each transfer shown on ``reporter``, every download's bytes counted
    on ``meter``; None with neither."""
    if reporter is None and meter is None:
        return None

    def emit(event: HubEvent) -> None:
        if meter is not None and event.kind == "download":
            meter.file_progress(f"{event.repo_id}/{event.filename}", event.done)
        if reporter is None:
            return
        if event.kind in ("download", "verify") and (event.total is None or event.done < event.total):
            return  # only the end of each transfer: the bar belongs to the merge
        rate = f" at {format_size(int(event.rate))}/s" if event.rate else ""
        reporter.message(f"{event.repo_id}: {event.message}{rate}")

    return emit


def run_merge(
    config_text: str,
    out_dir: str | os.PathLike[str],
    options: PlanOptions,
    settings: RunSettings,
    *,
    restart: bool = False,
    reporter: Reporter | None = None,
    should_stop: Callable[[], bool] = _never,
) -> Outcome:
    """Merge ``config_text`` into ``out_dir``; continue an unfinished run of the same plan there.

    Raises InputError (exit 2) before touching OUT; PlanChangedError when OUT holds another run and
    ``restart`` is false; InterruptedMerge when ``should_stop`` turned true; StorageError on write failures.
    ``out_dir`` may be ``hf://NAMESPACE/NAME[@BRANCH]``: write access is checked (exit 2) before anything else is
    read. ``settings`` (budgets, staging, the hub's commits) are described on :class:`RunSettings`.
    """
    config = load_config_text(config_text)
    target = Target.open(out_dir, settings)
    try:
        prepared = prepare(config, options, state_dir=settings.state_dir, cache_dir=settings.cache_dir,
                           reporter=reporter)
    except UnreachableError as exc:
        raise UnreachableInputError.before_start(exc) from None
    return run_plan(prepared, config_text, target, settings, restart=restart, reporter=reporter,
                    should_stop=should_stop)


def resume_merge(
    out_dir: str | os.PathLike[str],
    settings: RunSettings,
    *,
    reporter: Reporter | None = None,
    should_stop: Callable[[], bool] = _never,
    other_kind: RecordedPlanner | None = None,
) -> Outcome:
    """Finish the merge recorded for ``out_dir`` (from the ledger, else from OUT's manifest) with ``settings`` (they
    do not change the output, so they may differ from the first run's). An ``hf://`` OUT resumes from the repo
    alone when the state dir is gone.

    Raises LedgerError when neither exists, PlanChangedError when the inputs or resumerge changed, UsageError
    when the merge computes on a GPU that this machine lacks (the device is part of the output's identity).
    ``other_kind`` plans a recorded config of another kind than a merge config (:mod:`resumerge.api`, which
    decides what a run is, passes it).
    """
    target = Target.open(out_dir, settings).read_recorded()
    out, manifest, state_dir = target.out, target.manifest(), settings.state_dir
    ledger_path = run_dir(target.url, state_dir) / LEDGER_NAME
    row = None
    if ledger_path.exists():
        try:
            ledger = Ledger(ledger_path)
        except LedgerError as exc:
            if manifest is None:  # nothing to rebuild it from: refuse rather than guess
                exc.hint = f"OUT has no {MANIFEST_NAME} to rebuild it from; start over with resumerge run --restart"
                raise
            # Damaged but OUT has a manifest: _drive sets the ledger aside and rebuilds it from the manifest.
        else:
            row = ledger.run_row()
            committed = sum(1 for r in ledger.files() if r.status == "done")
            ledger.close()
            if row is not None and committed and target.hub is None and not out.exists():
                raise _moved(out, committed, resume_command("NEW_PATH", state_dir))
    if row is not None:
        text, opts, dirs = row.config_text, row.options, row.model_dirs
    elif manifest is not None:
        text, opts, dirs = manifest.config_text, dict(manifest.options), dict(manifest.model_dirs)
    elif target.hub is not None:  # nothing anywhere holds the run: only `run` can start it (never "try later")
        url = target.hub.url
        where = "it does not exist on the hub" if not target.hub.exists else f"the repo holds no {MANIFEST_NAME}"
        raise UsageError(f"nothing to resume in {url}: {where} and the state dir holds no ledger of it", path=url,
                         hint=f"start it with: resumerge run CONFIG {url} (pass the killed run's --state-dir if it "
                              "used one)")
    else:
        raise LedgerError(
            f"nothing to resume in {out}: no ledger in the state dir and no {MANIFEST_NAME}",
            path=str(out),
            hint="start the merge with resumerge run CONFIG OUT (pass --state-dir if you used one)",
        )
    other = other_kind(text, PlanOptions(**opts), dirs, settings, reporter) if other_kind is not None else None
    prepared = other or prepare(load_config_text(text), PlanOptions(**opts), model_dirs=dirs,
                                state_dir=state_dir, reporter=reporter)
    plan = prepared.plan
    settings = recorded_threads(plan.options.num_threads, {t.method for t in plan.tensors.values()}, settings,
                                reporter, plan.units)
    return run_plan(prepared, text, target, settings, resuming=True, reporter=reporter, should_stop=should_stop)


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


def _moved(out: Path, committed: int, where: str) -> OutputDirError:
    """A resume whose OUT vanished though the ledger records files committed there: the output was moved or
    deleted, and re-creating it would redo the whole merge in the wrong place."""
    return OutputDirError(
        f"{out} does not exist, though {committed} file(s) were committed there: the output may have moved",
        path=str(out),
        hint=f"resume it where it is now with {where}, or start over with resumerge run CONFIG {out} --restart",
    )


def run_plan(
    prepared: Prepared,
    config_text: str,
    target: Target,
    settings: RunSettings,
    *,
    restart: bool = False,
    resuming: bool = False,
    reporter: Reporter | None = None,
    should_stop: Callable[[], bool] = _never,
) -> Outcome:
    """The session path every kind of run ends in: run the frozen plan of ``prepared`` (of ``config_text``) into
    ``target``, journaled (continuing an unfinished run of the same plan there), under ``settings``, its units
    handed the run's resources, with the work beside it that the plan's last units wait for, if any.

    A new kind of run is a planner that makes a :class:`Prepared`, then this call. It builds the memory and GPU
    governors (UsageError, exit 2, for a budget too small), checks OUT, opens the hub inputs of the prepared
    inputs (the models the plan was built from; None when they are present already, as for a recipe's stages,
    which fetch theirs once), then takes the lock, reconciles OUT with the ledger and executes. ``restart``
    discards a different earlier run in OUT; ``resuming`` says the run was asked to continue one.
    """
    plan, inputs, beside = prepared.plan, prepared.inputs, prepared.beside
    from resumerge.engine.devices import set_torch_threads

    set_torch_threads(settings.num_threads)
    governors = (make_governor(plan, settings.max_memory),
                 gpu_governor(plan, plan.options.device, settings.max_gpu_memory))
    if beside is not None:
        beside.hold(governors[0])
    manifest = target.manifest()
    hub = None
    meter = TrafficMeter()  # both directions of the network, for the progress display
    if inputs is not None:
        hub = HubInputs.open(plan, inputs, state_dir=settings.state_dir, on_progress=hub_progress(reporter, meter),
                             governor=governors[0], max_disk=settings.max_disk)
    return _drive(prepared, config_text, target, manifest, settings, governors, hub, restart=restart,
                  resuming=resuming, reporter=reporter or NullReporter(), should_stop=should_stop, meter=meter,
                  late_notes=beside.notes if beside is not None else None)


def make_governor(plan: Plan, max_memory: int | None) -> MemoryGovernor:
    """A governor for ``plan`` under ``max_memory`` (or the default budget).

    Raises :class:`UsageError` (exit 2, before OUT is touched) when a tensor that must be held whole cannot fit,
    naming the smallest budget that works.
    """
    probe = SystemProbe()
    budget = max_memory if max_memory is not None else default_budget(probe)
    baseline = probe.rss()
    if not torch_import.loaded() and oversized_units(plan, budget, baseline + torch_import.IMPORT_RESERVE):
        # The merge will hold torch, which is not imported yet (downloads start first); near the budget, import
        # it now and measure rather than trust the reserve.
        torch_import.load()
        baseline = probe.rss()
    too_big = oversized_units(plan, budget, baseline)
    if too_big:
        worst = largest(too_big)
        raise UsageError(
            f"tensor {worst.tensor} ({worst.method}) needs more memory than the budget of {format_size(budget)}",
            tensor=worst.tensor,
            hint=f"the smallest budget that works is {format_size(worst.needed)}; rerun with --max-memory "
            f"{format_size(worst.needed, compact=True)} or more",
        )
    return MemoryGovernor(budget, probe)


def _drive(
    prepared: Prepared,
    config_text: str,
    target: Target,
    manifest: Manifest | None,
    settings: RunSettings,
    governors: tuple[MemoryGovernor, MemoryGovernor | None],
    hub: HubInputs | None,
    *,
    restart: bool,
    resuming: bool,
    reporter: Reporter,
    should_stop: Callable[[], bool],
    meter: TrafficMeter | None = None,
    late_notes: Callable[[], tuple[str, ...]] | None = None,
) -> Outcome:
    from resumerge.memory.allocator import tune_allocator
    from resumerge.store.runlock import RunLock

    plan = prepared.plan
    out, hub_out, command, state_dir = target.out, target.hub, target.command, settings.state_dir
    if plan.options.num_threads is not None:  # the resume reuses it anyway; the command says what it will do
        command = f"{command} -j {plan.options.num_threads}"
    governor, gpu = governors
    # What the output may keep on the local disk once the hub inputs kept in the cache are counted.
    max_disk = hub.output_budget(settings.max_disk) if hub is not None else settings.max_disk
    created = hub_out is None and not out.exists()  # removed again if the run is refused before writing to it
    if hub_out is None:
        out.mkdir(parents=True, exist_ok=True)
    rdir = run_dir(hub_out.url if hub_out else out, state_dir)
    # A repo cannot be locked from here: the run's lock file is, so two processes on this machine never collide
    # (and the refusal names the repo as written, hf://…).
    lock = RunLock(rdir, out) if hub_out is None else RunLock(rdir, hub_out.url, lock_out=False)
    try:
        lock.acquire()
    except BaseException:
        _remove_if_empty(out, created)
        raise
    notes: list[str] = []
    try:
        ledger = _open_ledger(rdir / LEDGER_NAME, notes)
        if hub_out is None and manifest is None and not (restart or resuming):
            ledger = _set_aside_stale(ledger, rdir / LEDGER_NAME, plan, notes)
    except BaseException:
        lock.release()
        _remove_if_empty(out, created)
        raise
    watch = InputWatch.of(plan.model_dirs, plan.inputs)
    ledger.commit_guard = watch.check
    xfsz = _ignore_sigxfsz()
    restore_allocator = tune_allocator()  # process-wide: put back when the run ends (a notebook goes on)
    try:
        if hub_out is not None and not hub_out.exists:  # the plan is recorded before the repo exists, never after
            # A state dir holding another plan for this repo is refused before the repo is created, not after.
            refuse_changed_plan(plan, hub_out.url, ledger, None, restart=restart, resuming=resuming)
            hub_out = create_recorded(hub_out, plan, config_text, ledger, restart=restart)
        staged: list[str] = []
        with _make_sink(plan, out, rdir, settings.staging, staged, hub_out, max_disk, should_stop,
                        _telling(reporter, ledger)) as sink:
            book, verified = open_run(plan, config_text, hub_out.url if hub_out else out, sink, ledger, manifest,
                                      restart=restart, resuming=resuming, notes=notes)
            reconcile(sink, ledger, book, log=notes, verified=verified)
            notes.extend(staged)
            resumed = sum(1 for r in ledger.files() if r.status == "done")
            for note in plan.notes:  # what the plan decided that the user must hear (status and the card show it too)
                ledger.event("plan", note)
            for note in [*notes, *plan.notes]:
                reporter.message(note)
            rows = ledger.files()
            done_shards = {r.name for r in rows if r.status == "done" and r.kind == "shard"}
            done_bytes = sum(s.file_size for s in plan.shards if s.name in done_shards)
            reporter.start(
                total_tensors=len(plan.tensors),
                done_tensors=sum(len(s.tensors) for s in plan.shards if s.name in done_shards),
                total_bytes=plan.total_bytes,
                done_bytes=done_bytes,
            )
            ledger.set_state("running")
            ledger.event("memory", f"budget {format_size(governor.budget)}", {"budget": governor.budget})
            reporter.memory_budget(governor.budget)
            governor.start()
            if gpu is not None:
                ledger.event("memory", f"{gpu.pool} budget {format_size(gpu.budget)}",
                             {"pool": gpu.pool, "budget": gpu.budget})
                gpu.start()
            sources = InputSources.local(plan.model_dirs) if hub is None else hub.attach(ledger, reporter)
            meter = meter or TrafficMeter()
            shown = getattr(reporter, "traffic", None)  # an optional hook: a reporter may not draw the network
            if shown is not None and watch_run(meter, plan, hub, sink, done_bytes):
                shown(meter.snapshot)
            # Transfers first (engine.cpupriority) in a run that downloads or uploads and streams nothing (a range
            # read's threads start from a reader's, whose priority they would take).
            transfers = (hub_out is not None or (hub is not None and hub.downloads is not None)) and not (
                hub is not None and hub.streams)
            try:
                with sources:
                    late = execute(plan, sources, sink, ledger, book, reporter, should_stop=should_stop,
                                   config_text=config_text, workers=settings.workers, governor=governor, gpu=gpu,
                                   late_notes=late_notes, transfers=transfers, resources=prepared.resources)
            except Stopped:
                ledger.set_state("interrupted", error="stopped by signal")
                raise InterruptedMerge("merge interrupted; every committed shard is kept",
                                       resume_command=command) from None
            except Exception as exc:
                error = _failure(exc, ledger, watch, command)
                if error is exc:
                    raise
                raise error from exc
            finally:
                if hub is not None:
                    hub.record(ledger)
                _record_memory(ledger, governor)
                _record_gpu_memory(ledger, gpu)
            book.set_state("done")
            ledger.set_state("done")
            created = False
            return Outcome(replace(plan, notes=plan.notes + late), out, resumed, tuple(notes),
                           target=hub_out.url if hub_out else None)
    finally:
        ledger.close()
        lock.release()
        _remove_if_empty(out, created)
        _restore_sigxfsz(xfsz)
        if restore_allocator is not None:
            restore_allocator()


def _make_sink(plan: Plan, out: Path, rdir: Path, staging: Staging, notes: list[str], hub_out: HubOutput | None,
               max_disk: int | None, should_stop: Callable[[], bool], tell: Callable[[str], None]) -> OutputSink:
    """The sink of this run: the hub repo, OUT staged on local disk (Drive and other mounts), or OUT itself."""
    if hub_out is not None:
        return hub_out.sink(plan, rdir, planned_files(plan), max_disk, should_stop, tell)
    stage_dir = _staging_dir(staging, plan, out, rdir, notes)
    return LocalDirSink(out) if stage_dir is None else StagedDirSink(out, stage_dir)


def _telling(reporter: Reporter, ledger: Ledger) -> Callable[[str], None]:
    """What a sink tells the user while the run goes on (a hub's commit-quota wait): shown on ``reporter`` and kept
    as a ``hub`` event of the ledger, which ``status`` shows."""

    def tell(text: str) -> None:
        reporter.message(text)
        with contextlib.suppress(ResumergeError):  # the message is shown; the ledger's disk may be what fails
            ledger.event("hub", text)

    return tell


def _open_ledger(path: Path, notes: list[str]) -> Ledger:
    """Open the run's ledger. A damaged one is never trusted: it is moved aside and a fresh ledger returned, which
    :func:`open_run` rebuilds from OUT's manifest (re-hashing every file the manifest lists) or fills with a new
    plan when OUT has no manifest (then nothing was ever committed there)."""
    ledger, note = Ledger.open_setting_aside(path)
    if note is not None:
        notes.append(note)
    return ledger


def _set_aside_stale(ledger: Ledger, path: Path, plan: Plan, notes: list[str]) -> Ledger:
    """A new run into an absent or empty OUT: a ledger recorded for another plan there describes a merge that is
    no longer in OUT (it was deleted, or moved) and is set aside rather than refused as "a merge planned
    differently"; returns the ledger to use."""
    row = ledger.run_row()
    if row is None or row.fingerprint == plan.fingerprint:
        return ledger
    ledger.close()
    aside = set_aside(path, suffix=".stale")
    notes.append(f"OUT holds no merge: the record of an earlier, different run into it was set aside as {aside.name}")
    return Ledger(path)


def _remove_if_empty(out: Path, created: bool) -> None:
    """Remove OUT when this run created it and stopped before writing to it: a refused run leaves nothing."""
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()


def _failure(exc: Exception, ledger: Ledger, watch: InputWatch, command: str) -> Exception:
    """Record in the ledger why the run stopped (best effort) and return the error to raise: a changed input (it
    explains any failure after it: a deleted file, a truncated one), a bare ``OSError`` as :class:`StorageError`
    (exit 3), an input error once a file is committed as :class:`InterruptedMerge` (exit 2 says nothing is written)."""
    error: Exception = watch.changed() or exc
    if isinstance(error, OSError):
        error = StorageError(f"I/O error on {error.filename or 'a file'}: {error.strerror or str(error)}",
                             path=str(error.filename) if error.filename else None,
                             hint="check the disk, then run resumerge resume OUT")
    if isinstance(error, InputError) and any(row.status == "done" for row in ledger.files()):
        error = InterruptedMerge(f"the merge stopped: {error.one_line()}", resume_command=command)
    if isinstance(error, ResumergeError):
        state = "interrupted" if isinstance(error, StorageError) else "failed"
        message = error.one_line()
    else:
        state, message = "failed", f"{type(error).__name__}: {error}"
    with contextlib.suppress(ResumergeError):  # the ledger's own disk may be what failed; report the first error
        ledger.set_state(state, error=message)
    return error


def _ignore_sigxfsz() -> Any:
    """Ignore SIGXFSZ while merging, so that a write past the file size limit (``ulimit -f``) fails with EFBIG —
    a clean StorageError, exit 3 — instead of killing the process. Returns the previous handler (None when not
    on the main thread, where handlers cannot be changed)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGXFSZ"):
        return None
    return signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _restore_sigxfsz(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGXFSZ, previous)


def _record_memory(ledger: Ledger, governor: MemoryGovernor | None) -> None:
    """Stop the governor and store its peak and adaptations in the ledger."""
    if governor is None:
        return
    governor.stop()
    peak = os_peak_rss() or governor.peak_rss
    for a in governor.adaptations[-100:]:
        ledger.event("adaptation", f"{a.knob} {a.old} -> {a.new}: {a.reason}")
    ledger.record_peak(peak, len(governor.adaptations))


def _staging_dir(choice: Staging, plan: Plan, out: Path, rdir: Path, notes: list[str]) -> Path | None:
    """The local directory to stage output files in, or None to write into OUT directly.

    Leftover temp files of earlier runs there are deleted (only resumerge's own temp names of planned files).
    """
    directory = staging_dir(choice, out, rdir)
    if directory is None:
        return None
    if directory == out or out in directory.parents:
        raise UsageError(f"the staging dir {directory} is inside OUT", hint="stage on local disk outside OUT")
    directory.mkdir(parents=True, exist_ok=True)
    planned = set(planned_files(plan))
    for leftover in directory.iterdir():
        if is_temp_name(leftover.name, planned):
            leftover.unlink()
    why = f"OUT is on {filesystem_type(out)}" if choice is None else "as asked"
    notes.append(f"staging output in {directory} and publishing to OUT by copy + verify ({why})")
    return directory


def _record_gpu_memory(ledger: Ledger, gpu: MemoryGovernor | None) -> None:
    """Stop the GPU governor and store its exact allocator peak and adaptations as events."""
    if gpu is None:
        return
    gpu.stop()
    peak = gpu.probe.peak() if isinstance(gpu.probe, CudaProbe) else gpu.peak_rss
    for a in gpu.adaptations[-100:]:
        ledger.event("adaptation", f"{gpu.pool} {a.knob} {a.old} -> {a.new}: {a.reason}")
    ledger.event("memory", f"{gpu.pool} peak {format_size(peak)}",
                 {"pool": gpu.pool, "peak": peak, "adaptations": len(gpu.adaptations)})

"""Drive one prepared plan into its target: the session path every kind of run ends in.

Order matters and is the safety argument: nothing touches OUT until the config, every input header and the
plan are valid; a non-empty OUT without resumerge's manifest is refused; the ledger records the plan and the
manifest is written before the first shard; the state becomes ``done`` only after the final manifest.
:class:`RunSession` holds one run: its prepared plan, target, settings and how it was asked (restart, resume, the
reporter, the stop flag), so its steps read them from one place instead of a parameter each.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.settings import RunSettings, Staging
from resumerge.errors import InputError, InterruptedMerge, ResumergeError, StorageError, UsageError
from resumerge.inputs.contents import opened_looks
from resumerge.inputs.model import InputWatch
from resumerge.inputs.source import InputSources
from resumerge.machine.durable import is_temp_name
from resumerge.machine.filesystems import filesystem_type, staging_dir
from resumerge.machine.memory import CudaProbe, MemoryGovernor, format_size, os_peak_rss
from resumerge.machine.torch_import import load_beside
from resumerge.merge.engine.devices import gpu_governor, make_governor
from resumerge.merge.engine.executor import Reporter, Stopped, kept_units
from resumerge.merge.engine.executors import Executor, executor_for
from resumerge.merge.engine.frozenplan import freeze
from resumerge.merge.engine.inputcontents import InputContents, Proving
from resumerge.merge.engine.inputfetch import HubInputs
from resumerge.merge.engine.job import Job
from resumerge.merge.engine.outdir import (
    EarlierRun,
    Recording,
    done_line,
    open_run,
    planned_files,
    record_plan,
    refuse_changed_plan,
)
from resumerge.merge.engine.phasing import admit_phases, record_phases, run_phases, settle_plan
from resumerge.merge.engine.quiet import NullReporter, never_stop
from resumerge.merge.engine.reconcile import reconcile
from resumerge.merge.engine.target import Target
from resumerge.merge.engine.traffic import TrafficMeter, watch_run
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.outguard import read_paths, refuse_out_over_inputs
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.roles import formats_line, formats_report, quantized
from resumerge.merge.store.ledger import LEDGER_NAME, Ledger, set_aside
from resumerge.merge.store.ledger_read import FORMATS_EVENT, INPUTS_EVENT
from resumerge.merge.store.manifest import Manifest
from resumerge.merge.store.sink import LocalDirSink, OutputSink, StagedDirSink

if TYPE_CHECKING:
    from resumerge.inputs.hub import HubEvent
    from resumerge.merge.engine.hubout import HubOutput


@dataclass(frozen=True)
class Outcome:
    """What a finished run did: the plan, what was already committed, and notes for the user."""

    plan: Plan
    out_dir: Path
    resumed_files: int
    notes: tuple[str, ...] = field(default=())
    target: str | None = None  # the hf:// repo when OUT is one (then out_dir is only its name)
    detail: str | None = None  # what else the run did, for its "done" line (a recipe: its stages)
    elapsed_seconds: float | None = field(default=None, compare=False)  # the run's wall time, planning excepted

    def __repr__(self) -> str:
        """``done: OUT, 8 files, 3 resumed, 6.1 s`` — the CLI's "done" line, not the plan's every tensor."""
        return done_line(self.target or str(self.out_dir), len(planned_files(self.plan)), self.resumed_files,
                         self.elapsed_seconds, self.detail)


def hub_progress(reporter: Reporter | None, meter: TrafficMeter | None = None) -> Callable[[HubEvent], None] | None:
    """The hub progress callback: each transfer's end shown on ``reporter``, downloads counted on ``meter`` (None
    without either)."""
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


class RunSession:
    """One run of a prepared plan into its target: the session path every kind of run ends in (a merge config, a
    recipe's stage, MoE upcycling, a LoRA extraction alike), from the governors to the :class:`Outcome`.

    ``prepared`` holds the frozen plan (of ``config_text``), the inputs it was built from (their hub files are
    fetched here; None when present already, as for a recipe's stages), the run's resources handed to every unit,
    and the work beside the merge that the plan's last units wait for. ``restart`` discards a different earlier run
    in OUT; ``resuming`` says the run was asked to continue one; ``should_stop`` is polled at safe points.
    """

    def __init__(self, prepared: Prepared, config_text: str, target: Target, settings: RunSettings, *,
                 restart: bool = False, resuming: bool = False, reporter: Reporter | None = None,
                 should_stop: Callable[[], bool] = never_stop) -> None:
        self.prepared, self.config_text, self.target, self.settings = prepared, config_text, target, settings
        self.earlier, self.should_stop = EarlierRun(restart, resuming), should_stop
        self.reporter: Reporter = reporter or NullReporter()

    def run(self) -> Outcome:
        """Build the memory and GPU governors (UsageError, exit 2, for a budget too small), check OUT, open the hub
        inputs, then take the lock, reconcile OUT with the ledger and execute, journaled (continuing an unfinished
        run of the same plan there). Raises InterruptedMerge when stopped, PlanChangedError for another run in OUT,
        StorageError on write failures."""
        from resumerge.merge.engine.devices import set_torch_threads

        plan, inputs, beside, settings = self.prepared.plan, self.prepared.inputs, self.prepared.beside, self.settings
        if self.target.hub is None:  # OUT over an input: refused before OUT is looked at (a --restart deletes)
            refuse_out_over_inputs(self.target.out, plan)
        set_torch_threads(settings.num_threads)
        # What the flags decide a phase cannot do (a budget its step does not fit in): refused before OUT is touched.
        admit_phases(self.prepared.phases, plan, settings.max_memory)
        governors = (make_governor(plan, settings.max_memory),
                     gpu_governor(plan, plan.options.device, settings.max_gpu_memory))
        if beside is not None:
            beside.hold(governors[0])
        # Ray missing, unreachable or unfit for the run: refused before OUT is touched.
        executor = executor_for(settings, work_beside=beside is not None)
        manifest = self.target.manifest()
        hub = None
        meter = TrafficMeter()  # both directions of the network, for the progress display
        if inputs is not None:
            hub = HubInputs.open(plan, inputs, state=settings.state,
                                 on_progress=hub_progress(self.reporter, meter), governor=governors[0],
                                 max_disk=settings.max_disk)
        return self._drive(manifest, governors, hub, meter, beside.notes if beside is not None else None, executor)

    def _drive(self, manifest: Manifest | None, governors: tuple[MemoryGovernor, MemoryGovernor | None],
               hub: HubInputs | None, meter: TrafficMeter,
               late_notes: Callable[[], tuple[str, ...]] | None, executor: Executor) -> Outcome:
        from resumerge.machine.memory.allocator import tune_allocator
        from resumerge.machine.runlock import RunLock

        plan, settings, reporter, earlier = self.prepared.plan, self.settings, self.reporter, self.earlier
        restart = earlier.restart
        config_text, should_stop = self.config_text, self.should_stop
        out, hub_out, command = self.target.out, self.target.hub, self.target.command
        if plan.options.num_threads is not None:  # the resume reuses it anyway; the command says what it will do
            command = f"{command} -j {plan.options.num_threads}"
        governor, gpu = governors
        # What the output may keep on the local disk once the hub inputs kept in the cache are counted.
        max_disk = hub.output_budget(settings.max_disk) if hub is not None else settings.max_disk
        created = hub_out is None and not out.exists()  # removed again if the run is refused before writing to it
        if hub_out is None:
            out.mkdir(parents=True, exist_ok=True)
        rdir = self.target.locations.run_dir
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
            if hub_out is None and manifest is None and not (restart or earlier.resuming):
                ledger = _set_aside_stale(ledger, rdir / LEDGER_NAME, plan, notes, out)
        except BaseException:
            lock.release()
            _remove_if_empty(out, created)
            raise
        frozen = functools.partial(freeze, self.prepared)  # stored once, when the plan is first recorded
        # How each local input looked when the plan opened it: a file re-saved since then stops the run.
        seen = opened_looks(self.prepared.inputs.models.values()) if self.prepared.inputs is not None else {}
        watch = InputWatch.of(plan.model_dirs, plan.inputs, seen)
        ledger.commit_guard = watch.check
        xfsz = _ignore_sigxfsz()
        restore_allocator = tune_allocator()  # process-wide: put back when the run ends (a notebook goes on)
        importing: threading.Thread | None = None
        proving: Proving | None = None
        try:
            # Every local input checked before anything is written or created for the run: as the plan saw it, and
            # in a continued run holding the bytes recorded when the run started (else PlanChangedError). The
            # digests are kept in the state dir this run uses, for the next run over the same files.
            contents = InputContents(plan, ledger, rdir.parent, seen=seen, restart=restart, tell=reporter.message)
            if hub_out is not None and not hub_out.exists:  # the plan is recorded before the repo exists, never after
                # A state dir holding another plan for this repo is refused before the repo is created, not after.
                refuse_changed_plan(plan, hub_out.url, ledger, None, earlier, config_text=config_text)
                from resumerge.merge.engine.hubout import create_recorded  # the hub's client: for a repo output only

                hub_out = create_recorded(hub_out, plan, config_text, ledger, restart=restart,
                                          recording=Recording(self.prepared.kind, frozen))
            staged: list[str] = []
            with _make_sink(plan, out, rdir, settings.staging, staged, hub_out, max_disk, should_stop,
                            _telling(reporter, ledger)) as sink:
                # A file planned in units is written in place where both the sink and the executor can (a folder OUT,
                # this process's threads): an optional attribute, as executors written before it keep working.
                in_place = sink.writes_in_place and bool(getattr(executor, "journals_units", False))
                book, verified = open_run(plan, config_text, hub_out.url if hub_out else out, sink, ledger, manifest,
                                          earlier, notes=notes,
                                          recording=Recording(self.prepared.kind, frozen, in_place))
                # A first run computed here into a folder (nothing committed yet, no hub): torch (1-2 CPU s) imported
                # and the inputs proved while the merge's first units compute, not before them; a shard is published
                # only once the proof is recorded (the local inputs' check, as a hub download's). Elsewhere the proof
                # comes first, before the first commit (a hub run's import waits for its downloads to start).
                fetches = hub is not None and (hub.downloads is not None or hub.streams)
                here = not fetches and hub_out is None and getattr(executor, "computes_here", False)
                if here:
                    importing = load_beside()
                committed = any(r.status == "done" for r in ledger.files()) or any(
                    u.status == "done" for u in ledger.units())
                if here and not committed:
                    proving = contents.record_beside(ledger, notes, after=importing)
                else:
                    contents.record(ledger, notes)  # before the first commit: what a later resume proves against
                reconcile(sink, ledger, book, log=notes, verified=verified, in_place=in_place)
                notes.extend(staged)
                resumed = sum(1 for r in ledger.files() if r.status == "done")
                # What the plan decided that the user must hear (status and the card show it too).
                for note in (*plan.notes, *whole_files(plan, in_place)):
                    ledger.event("plan", note)
                report = formats_report(plan)
                if quantized(report):  # verify and status read what was planned (a plain run's ledger as before)
                    ledger.event(FORMATS_EVENT, formats_line(report), report)
                if plan.accounting is not None:  # what became of every input tensor (status --json shows it)
                    ledger.event(INPUTS_EVENT, plan.accounting.summary(), plan.accounting.to_json())
                for note in [*notes, *plan.notes, *whole_files(plan, in_place)]:
                    reporter.message(note)
                # The phases before the merge, recorded with the plan, run now: a kill in one leaves a recorded
                # run, which resume continues from the phase's journal (engine.phasing).
                ledger.set_state("running")
                record_phases(ledger, self.prepared.phases, plan)
                try:
                    run_phases(ledger, self.prepared.phases, plan, reporter.message)
                except Exception as exc:  # recorded as the merge's own failures are
                    error = _failure(exc, ledger, watch, command)
                    if error is exc:
                        raise
                    raise error from exc
                settle_plan(ledger, self.prepared, lambda settled: record_plan(
                    settled.plan, config_text, hub_out.url if hub_out else out, ledger,
                    Recording(self.prepared.kind, functools.partial(freeze, settled), in_place)))
                rows = ledger.files()
                done_shards = {r.name for r in rows if r.status == "done" and r.kind == "shard"}
                done_bytes = sum(s.file_size for s in plan.shards if s.name in done_shards)
                kept = kept_units(ledger, done_shards)  # units of a file written in place, kept
                units = {s.name: plan.file_units(s) for s in plan.shards if kept.get(s.name)}
                done_bytes += sum(units[f][i][1] - units[f][i][0] for f, indices in kept.items() for i in indices)
                reporter.start(
                    total_tensors=len(plan.tensors),
                    done_tensors=sum(len(s.tensors) for s in plan.shards if s.name in done_shards)
                    + sum(len(units[f][i][2]) for f, indices in kept.items() for i in indices),
                    total_bytes=plan.total_bytes,
                    done_bytes=done_bytes,
                )
                ledger.event("memory", f"budget {format_size(governor.budget)}", {"budget": governor.budget})
                reporter.memory_budget(governor.budget)
                governor.start()
                if gpu is not None:
                    ledger.event("memory", f"{gpu.pool} budget {format_size(gpu.budget)}",
                                 {"pool": gpu.pool, "budget": gpu.budget})
                    gpu.start()
                sources = InputSources.local(plan.model_dirs) if hub is None else hub.attach(ledger, reporter)
                if proving is not None:
                    sources = sources.with_proof(proving.checked, proving.reads)  # units hash what they read
                shown = getattr(reporter, "traffic", None)  # an optional hook: a reporter may not draw the network
                if shown is not None and watch_run(meter, plan, hub, sink, done_bytes):
                    shown(meter.snapshot)
                # Transfers first (engine.cpupriority) in a run that downloads or uploads and streams nothing (a range
                # read's threads start from a reader's, whose priority they would take).
                transfers = (hub_out is not None or (hub is not None and hub.downloads is not None)) and not (
                    hub is not None and hub.streams)
                job = Job(plan, sources, sink, ledger, book, reporter, should_stop, config_text,
                          self.prepared.resources, settings, governor, gpu, late_notes, transfers, hub)
                try:
                    with sources:
                        late = executor.run(job)
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
            if proving is not None:
                proving.leave()  # a proof still reading records nothing in the ledger closed now
            ledger.close()
            lock.release()
            _remove_if_empty(out, created)
            _restore_sigxfsz(xfsz)
            if restore_allocator is not None:
                restore_allocator()
            if importing is not None:  # a run that ends before its first tensor never leaves torch half imported
                importing.join()


def _make_sink(plan: Plan, out: Path, rdir: Path, staging: Staging, notes: list[str], hub_out: HubOutput | None,
               max_disk: int | None, should_stop: Callable[[], bool], tell: Callable[[str], None]) -> OutputSink:
    """The sink of this run: the hub repo, OUT staged on local disk (Drive and other mounts), or OUT itself."""
    if hub_out is not None:
        return hub_out.sink(plan, rdir, planned_files(plan), max_disk, should_stop, tell)
    stage_dir = _staging_dir(staging, plan, out, rdir, notes)
    reads = read_paths(plan)  # never deleted nor replaced, whatever the run decides
    return LocalDirSink(out, reads=reads) if stage_dir is None else StagedDirSink(out, stage_dir, reads=reads)


def whole_files(plan: Plan, in_place: bool) -> tuple[str, ...]:
    """What the user must hear when the plan writes a file in units (a GGUF output) but the run commits every file
    whole, not ``in_place`` (a hub repo, a copy staged for Drive, a cluster's workers): an interruption loses the
    file being written."""
    if in_place or not any(s.units for s in plan.shards):
        return ()
    names = ", ".join(s.name for s in plan.shards if s.units)
    return (f"{names} committed whole (this run commits files, not parts of one: an hf:// or staged OUT, or the "
            "ray executor): an interruption loses the file being written; a local OUT keeps each unit of "
            "--out-shard-size written",)


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


def _set_aside_stale(ledger: Ledger, path: Path, plan: Plan, notes: list[str], out: Path) -> Ledger:
    """A new run into an OUT without a manifest: a ledger that records files committed there, none of which OUT
    holds any more (it was deleted, emptied or moved), or that records another plan with nothing of it in OUT,
    describes a merge that is no longer there. It is set aside, in one note, rather than refused as "a merge
    planned differently" or followed file by file ("missing: rebuilding it" for each), and the run starts afresh
    (``status`` then shows this run's time and peak, not the earlier one's). A ledger whose committed files OUT
    still holds is OUT's record (its manifest was deleted or damaged): kept. Returns the ledger to use."""
    row = ledger.run_row()
    if row is None:
        return ledger
    committed = [r.name for r in ledger.files() if r.status == "done"]
    if any((out / name).is_file() for name in committed) or (row.fingerprint == plan.fingerprint and not committed):
        return ledger
    ledger.close()
    aside = set_aside(path, suffix=".stale")
    if row.fingerprint != plan.fingerprint:
        notes.append(f"OUT holds no merge: the record of an earlier, different run into it was set aside as "
                     f"{aside.name}")
    else:
        notes.append(f"OUT holds none of the {len(committed)} files an earlier run of this merge committed there: "
                     f"merging from the start (its record set aside as {aside.name})")
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
    """Stop the governor and store its peak, adaptations and admissions in the ledger."""
    if governor is None:
        return
    governor.stop()
    peak = os_peak_rss() or governor.peak_rss
    for a in governor.adaptations[-100:]:
        ledger.event("adaptation", f"{a.knob} {a.old} -> {a.new}: {a.reason}")
    ledger.record_peak(peak, len(governor.adaptations))
    if governor.admitted:  # none on a cluster's driver: its nodes admit its units
        # The budget again: status reads it from the latest memory event.
        ledger.event("memory", f"{governor.admitted} admissions of work", {
            "budget": governor.budget, "admissions": governor.admitted, "largest": governor.largest_admitted})


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

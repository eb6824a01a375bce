"""What a merge will cost before it starts: disk, downloads, peak RAM and time, and whether it fits here.

``resumerge plan`` prints this; :func:`resumerge.api.estimate` returns it. Everything comes from the plan (headers
only), the hub metadata already fetched to build it, the machine's memory and a short disk speed probe (see
:mod:`resumerge.machine.diskprobe`). Nothing is written except the probe's own temp file, which is always deleted.
The result and its JSON schema are in :mod:`resumerge.analyses.estimate.costs`.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from resumerge.analyses.estimate.compute import start_compute
from resumerge.analyses.estimate.computegroup import ComputeGroup, compute_lines
from resumerge.analyses.estimate.costs import (
    Estimate,
    ModelDownload,
    OutputSize,
    TimeEstimate,
)
from resumerge.analyses.estimate.cpuprobe import probe_transfer_cost
from resumerge.analyses.estimate.disks import disk_needs, disk_reason, probe_dir
from resumerge.analyses.estimate.measuring import Measuring, Passes, PassMakers, Startup
from resumerge.analyses.estimate.memory import memory_estimate
from resumerge.analyses.estimate.network import MEASURED, Bandwidth, NetworkEstimate, measure_download
from resumerge.analyses.estimate.torchside import TorchHere, TorchProcess, TorchSide
from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings, Staging
from resumerge.errors import LedgerError
from resumerge.inputs.catalog import Inputs
from resumerge.machine.checksums import SHA256, XXH3_128
from resumerge.machine.diskprobe import (
    DiskSpeed,
    nearest_existing,
    probe_directory,
    probe_file_read,
    unwritable,
)
from resumerge.machine.filesystems import staging_dir
from resumerge.machine.memory import MemoryProbe, SystemProbe, collector_paused, format_size, usable_cores
from resumerge.machine.torch_import import loaded as torch_loaded
from resumerge.merge.engine.executor import CONCURRENCY
from resumerge.merge.engine.hubdisk import hub_disk_need
from resumerge.merge.engine.inputfetch import plan_fetch
from resumerge.merge.methods.registry import MethodSpec
from resumerge.merge.plan.fetching import STREAM, FileFetch
from resumerge.merge.plan.fusedscales import measured_before
from resumerge.merge.plan.merge_plan import Plan, PlanOptions, TensorPlan
from resumerge.merge.plan.outguard import refuse_out_over_inputs, refuse_state_in_out
from resumerge.merge.plan.prepared import Prepared
from resumerge.merge.plan.sidefiles import aux_files, render_aux
from resumerge.merge.plan.workorder import compute_order
from resumerge.merge.store.manifest import read_manifest


@dataclass(frozen=True)
class _Reading:
    """This machine's memory as a probe read it once (a :class:`~resumerge.machine.memory.probe.MemoryProbe` whose
    readings stay put)."""

    rss_bytes: int
    available_bytes: int
    limit_bytes: int | None

    @classmethod
    def of(cls, probe: MemoryProbe) -> _Reading:
        return cls(probe.rss(), probe.available(), probe.limit())

    def rss(self) -> int:
        return self.rss_bytes

    def available(self) -> int:
        return self.available_bytes

    def limit(self) -> int | None:
        return self.limit_bytes

    def reclaim(self) -> None:
        return None


def estimate(
    prepared: Prepared,
    config_text: str,
    settings: RunSettings,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    measuring: Measuring | None = None,
    choose_inputs: bool = True,
    to_hub: bool = False,
    torch_side: TorchSide | None = None,
    passes: Passes = Passes(),
) -> Estimate:
    """Estimate what merging the plan of ``prepared`` into ``out_dir`` costs here under ``settings``, and decide
    whether it fits.

    The prepared inputs are the opened models the plan was built from (their hub metadata gives download sizes);
    ``settings`` (state dir, memory budget, staging, disk budget) mean what they mean for ``resumerge run``. The
    merge process's RSS before any tensor is read is taken as this process's own, which is right when the merge
    runs in a process like this one (``resumerge plan`` before ``resumerge run``, or :func:`resumerge.api.estimate`
    before :func:`resumerge.api.run` in one notebook). ``measuring`` says how this machine is measured (at its
    defaults when None), the merge's start-up included. Without
    ``out_dir`` the output's disk is not checked. Never raises for a merge that does not fit: the reasons are in the
    result. ``choose_inputs`` false counts every hub weight file as downloaded (a recipe stage: recipes download
    their inputs whole). ``settings.max_disk`` (``--max-disk``) bounds the local disk: it decides which hub files
    are streamed and what an ``hf://`` OUT may stage; ``to_hub`` says OUT is a hub repo, whose staging must then
    fit under it. ``passes`` (:class:`Passes`) are the forward passes the run makes besides the merge.
    ``torch_side`` runs the speed sample (None: in this process; see :mod:`resumerge.analyses.estimate.torchside`).
    """
    plan, inputs = prepared.plan, prepared.opened()
    prepass, first_pass = passes.prepass, passes.first_pass
    measuring = measuring or Measuring()
    startup = measuring.startup
    probe_bytes, disk_free = measuring.probe_bytes, measuring.disk_free
    state, max_disk, workers = settings.state, settings.max_disk, CONCURRENCY
    notes: list[str] = []
    out = Path(os.path.abspath(out_dir)) if out_dir is not None else None
    if out is not None:  # run's own refusals (exit 2), before anything is measured
        refuse_out_over_inputs(out, plan)
        refuse_state_in_out(out, state)
    committed = _committed_here(plan, out, notes)
    pending = [s for s in plan.shards if s.name not in committed]
    torch_side = torch_side or TorchHere()
    facts, memory_now = torch_side.facts(), _Reading.of(SystemProbe())
    # Nothing pending (a finished merge): no sample is read and no method is timed. A helper process times a
    # sample timed by its thread's CPU while this one estimates the rest, and any other once the rest is done (see
    # start_compute; the memory is read before: the sample's buffers are not another process's for the run).
    compute_groups = (start_compute(plan, computed_once(plan, pending), max_seconds=measuring.compute_budget,
                                    workers=workers, side=torch_side, resources=prepared.resources)
                      if pending else tuple)
    staging_dir = _staging_dir(settings.staging, out, state)
    output = _output_size(plan, config_text, out, committed, staging_dir, pending, to_hub)
    fetch = plan_fetch(plan, inputs, max_disk=max_disk) if choose_inputs else ()
    downloads = _downloads(inputs, state, {(c.model, c.file) for c in fetch if c.how != STREAM}
                           if choose_inputs else None)
    remote = {(c.model, c.file) for c in fetch if c.how == STREAM}
    memory, memory_reasons = memory_estimate(plan, pending, memory_now, settings.max_memory, workers, remote, facts)
    disks = disk_needs(plan, output, downloads, inputs, out, state, disk_free,
                   first_pass.state_bytes if first_pass is not None else 0)
    speed = probe_directory(probe_dir(out), probe_bytes, disk_free=disk_free) if out is not None else None
    compute = compute_groups()
    timing = replace(_time(plan, pending, output, downloads, committed, speed, probe_bytes, compute, to_hub),
                     startup_seconds=startup.seconds)
    if prepass is not None:
        seconds, cpu_seconds, peak, beside, cores, problem = prepass(timing.read_bytes_per_s)
        memory_reasons += [problem] if problem else []  # the run's own guard would refuse the pass
        timing = replace(timing, prepass_seconds=seconds, prepass_beside=beside, prepass_cpu_seconds=cpu_seconds,
                         cores_available=cores)
        memory = replace(memory, prepass_bytes=peak, prepass_beside=beside)
    if first_pass is not None:  # its disk work at the speeds measured, the merge's compute its reads redo
        timing = replace(timing, first_pass_seconds=first_pass.seconds(
            timing.read_bytes_per_s, timing.write_bytes_per_s, timing.compute_seconds))
        # its own refusal's figure (its process's baseline and its step), the one a run's phase names too
        # and the merge's after it, in the process the pass leaves (its modules, the encoders' kernels loaded)
        memory = replace(memory, first_pass_bytes=first_pass.held_bytes,
                         first_pass_baseline_bytes=first_pass.baseline_bytes,
                         first_pass_merge_baseline_bytes=first_pass.merge_baseline_bytes,
                         smallest_budget=max(memory.smallest_budget, first_pass.smallest_budget,
                                             first_pass.merge_budget))
        if first_pass.smallest_budget > memory.budget:  # the run's phase refuses it (exit 2) before it starts
            memory_reasons.append(f"memory: {first_pass.what} needs a budget of "
                                  f"{format_size(first_pass.smallest_budget)}, more than "
                                  f"{format_size(memory.budget)}: rerun with --max-memory "
                                  f"{format_size(first_pass.smallest_budget, compact=True)} or more")
        elif first_pass.merge_budget > memory.budget:  # so does it the merge after it
            memory_reasons.append(f"memory: the merge after {first_pass.what} needs a budget of "
                                  f"{format_size(first_pass.merge_budget)}, more than "
                                  f"{format_size(memory.budget)}: rerun with --max-memory "
                                  f"{format_size(first_pass.merge_budget, compact=True)} or more")
    memory_reasons = memory_reasons or [r for r in [memory.over_budget()] if r]  # never "fits" over the budget
    reasons = memory_reasons + [r for d in disks if not d.fits for r in [disk_reason(d, output)]]
    reasons += [r for r in [unwritable(state.root, "the state dir")] if r]  # run would stop at once
    if out is not None and not to_hub and not out.exists():  # an existing OUT is judged by run
        reasons += [r for r in [unwritable(out, "OUT", "choose an OUT on a writable filesystem")] if r]
    hub = hub_disk_need(plan, max_disk)
    if to_hub and hub.problem:
        reasons.append(hub.problem)
    network = _network(plan, inputs, output, downloads, fetch, timing, to_hub, measuring,
                       nearest_existing(state.root))
    return Estimate(plan, output, downloads, memory, tuple(disks), timing, tuple(reasons), tuple(notes), fetch,
                    hub, network, first_pass=first_pass)


def _network(plan: Plan, inputs: Inputs, output: OutputSize, downloads: Mapping[str, ModelDownload],
             fetch: Sequence[FileFetch], timing: TimeEstimate, to_hub: bool, measuring: Measuring,
             state_dir: Path) -> NetworkEstimate | None:
    """Bytes each way and the pipelined wall time (at ``measuring.bandwidth``, else the rate measured); None when
    the merge touches no network. The transfers' CPU is probed in ``state_dir`` unless ``measuring.probe_bytes`` is 0
    (then it counts as nothing). Torch's import (``measuring.startup.import_seconds``, part of the timing's
    start-up) comes after the first bytes move."""
    down = sum(d.bytes for d in downloads.values()) + sum(c.fetch_bytes for c in fetch if c.how == STREAM)
    up = output.total_bytes - output.committed_bytes if to_hub else 0
    if not down and not up:
        return None
    link, probe_bytes, import_seconds = measuring.bandwidth, measuring.probe_bytes, measuring.startup.import_seconds
    if link is None:
        rate = _measure_link(inputs, fetch) if down and probe_bytes > 0 else None
        link = Bandwidth(rate, None, MEASURED)
    # Start-up comes before any transfer but torch's import, which overlaps the first ones; an hf:// OUT has no local
    # disk to probe: the local merge is then compute.
    start = timing.startup_seconds + timing.prepass_seconds
    local = timing.seconds - start if timing.seconds is not None else timing.compute_seconds
    cost = probe_transfer_cost(state_dir) if probe_bytes > 0 else None
    total = max(1, plan.total_bytes)
    order = compute_order(plan)  # the first shard computed waits for its inputs; the last one's upload is the tail
    first = order[0].file_size / total if order else 0.0
    return NetworkEstimate(down, up, link, local, first_share=min(1.0, first),
                           tail_bytes=order[-1].file_size if order else 0, startup_seconds=start - import_seconds,
                           import_seconds=import_seconds,
                           transfer_cpu_seconds=cost.seconds(down, up) if cost is not None else 0.0,
                           cores=usable_cores())


def _measure_link(inputs: Inputs, fetch: Sequence[FileFetch]) -> float | None:
    """The download rate measured on the largest hub weight file the merge fetches (two range reads)."""
    from resumerge.inputs.hub.ranges import RangeClient, RetryPolicy

    fetched = [c for c in fetch if c.fetch_bytes and c.model in inputs.hub]
    if not fetched:
        return None
    largest = max(fetched, key=lambda c: c.size)
    meta = inputs.hub[largest.model]
    client = RangeClient(meta.settings, meta.repo_id, meta.commit, largest.file, largest.size,
                         policy=RetryPolicy(attempts=1))
    return measure_download(client.read, largest.size)


# -- output -----------------------------------------------------------------------------------------------------


def _committed_here(plan: Plan, out: Path | None, notes: list[str]) -> dict[str, int]:
    """Files of this very plan already committed in OUT (a resumable run), by name -> bytes."""
    if out is None or not out.is_dir():
        return {}
    try:
        manifest = read_manifest(out)
    except LedgerError as exc:
        notes.append(f"{out} holds an unreadable manifest ({exc.one_line()}); run rewrites it from the run's "
                     "ledger, and refuses OUT without one")
        return {}
    if manifest is None:
        if any(out.iterdir()):
            notes.append(f"{out} is not empty and was not written by resumerge: run will refuse it")
        return {}
    if manifest.fingerprint != plan.fingerprint:
        notes.append(f"{out} holds a different merge: run refuses it unless --restart (which deletes its files)")
        return {}
    return {name: int(doc["bytes"]) for name, doc in manifest.committed.items()}


def _staging_dir(choice: Staging, out: Path | None, state: StateDir) -> Path | None:
    """Where shards are written before they reach OUT, as ``resumerge run`` decides (None: into OUT)."""
    return staging_dir(choice, out, state.run_dir(out)) if out is not None else None


def _output_size(plan: Plan, config_text: str, out: Path | None, committed: Mapping[str, int],
                 staging_dir: Path | None, pending: Sequence[Any], to_hub: bool) -> OutputSize:
    from resumerge.merge.engine.outdir import fresh_manifest

    aux = {a.name: len(render_aux(plan, a, config_text)) for a in aux_files(plan)}
    sizes = {s.name: s.file_size for s in plan.shards} | aux
    # The finished manifest lists every file with its size and a checksum of fixed length: its size is exact (for a
    # new run: a hub repo's are sha256, a folder's xxh3-128, as their sinks record them; a run continued keeps the
    # kind its records have, the same within a few dozen bytes).
    recorded = (SHA256 if to_hub else XXH3_128).placeholder()
    final = fresh_manifest(plan, config_text, {n: {"bytes": b, "sha256": recorded} for n, b in sizes.items()})
    manifest_bytes = len(replace(final, state="done").to_bytes())
    largest = max((s.file_size for s in plan.shards), default=0)
    return OutputSize(
        dir=str(out) if out is not None else None,
        shard_bytes=plan.total_bytes,
        aux_bytes=sum(aux.values()),
        manifest_bytes=manifest_bytes,
        largest_shard_bytes=largest,
        committed_bytes=sum(committed.get(n, 0) for n in sizes),
        staging_dir=str(staging_dir) if staging_dir is not None else None,
        staging_bytes=max((s.file_size for s in pending), default=0) if staging_dir is not None else 0,
    )


# -- downloads --------------------------------------------------------------------------------------------------


def _downloads(inputs: Inputs, state: StateDir,
               wanted: set[tuple[str, str]] | None) -> dict[str, ModelDownload]:
    """Per hub input: bytes to fetch (less what partial downloads hold), to verify, and already verified, of the
    ``wanted`` (model, file) pairs, those the plan reads and does not stream (None: every weight file)."""
    if not inputs.hub:
        return {}
    from resumerge.inputs.hub.cache import RepoCache
    from resumerge.inputs.hub.download import partial_size
    from resumerge.inputs.hub.records import DB_NAME

    records_db = state.records_dir / DB_NAME
    found: dict[str, ModelDownload] = {}
    for key, meta in inputs.hub.items():
        repo = RepoCache(meta.settings.cache_dir, meta.repo_id)
        fetch = verify = cached = 0
        for name in (n for n in meta.weight_files if wanted is None or (key, n) in wanted):
            remote = meta.files[name]
            size = remote.size if remote.size is not None else meta.headers[name].file_size
            present = [p for p in (repo.snapshot(meta.commit, name), repo.blob(remote.etag)) if p.exists()]
            blob = present[0].resolve() if present else None  # the blob may be cached for another commit
            if blob is not None and blob.stat().st_size == size:
                if _trusted(records_db, blob, remote.algorithm, remote.etag):
                    cached += size
                else:
                    verify += size
            else:
                fetch += max(0, size - partial_size(repo, remote))
        found[key] = ModelDownload(meta.repo_id, meta.commit, fetch, verify, cached)
    return found


def _trusted(db: Path, blob: Path, algorithm: str, digest: str) -> bool:
    """Whether the verification records trust ``blob``; opened only when they exist, so ``plan`` creates none."""
    if not db.is_file():
        return False
    from resumerge.inputs.hub.records import VerifyRecords

    try:
        with VerifyRecords(db.parent) as records:
            return records.trusted(blob, algorithm, digest)
    except (sqlite3.Error, OSError):
        return False


# -- time -------------------------------------------------------------------------------------------------------


def computed_once(plan: Plan, pending: Sequence[Any]) -> list[Any]:
    """Those of the ``pending`` shards that are computed: one of the files one computation writes together (a GGUF
    release's; :meth:`~resumerge.outputs.containers.OutputContainer.lead`), every shard of any other output."""
    leads: set[str] = set()
    found = []
    for shard in pending:
        lead = plan.container.lead(shard.name)
        if lead not in leads:
            leads.add(lead)
            found.append(shard)
    return found


def _time(plan: Plan, pending: Sequence[Any], output: OutputSize, downloads: Mapping[str, ModelDownload],
          committed: Mapping[str, int], speed: DiskSpeed | None, probe_bytes: int,
          compute: Sequence[ComputeGroup] = (), to_hub: bool = False) -> TimeEstimate:
    notes = compute_lines(list(compute))
    method_of = plan.method_of
    tensors = plan.tensors
    computed = computed_once(plan, pending)
    read_bytes = sum(_read_share(method_of(tp), tp) for s in computed for tp in map(tensors.__getitem__, s.tensors))
    # NVFP4's group-scale pass: each fused group's members merged (their inputs read) once more first
    again = [tensors[m] for g in measured_before(tensors, (n for s in computed for n in s.tensors)).values()
             for m in g]
    if again:
        more = sum(_read_share(method_of(tp), tp) for tp in again)
        read_bytes += more
        notes.append(f"NVFP4 group scales: {len(again)} tensor(s) of fused groups merged once more first, to measure "
                     f"each group's largest magnitude ({format_size(more)} of inputs read again)")
    read_speed = _input_read_speed(plan, probe_bytes)
    write_speed = speed.write_bytes_per_s if speed is not None else None
    if read_speed is None and speed is not None and speed.read_bytes_per_s is not None:
        read_speed = speed.read_bytes_per_s
        notes.append("inputs are not on disk yet: their read speed is taken as OUT's")
    if speed is None:
        # An hf:// OUT is given but has no local disk to probe: its speed is the upload's, which is not estimated.
        notes.append("OUT is a hub repo: upload time is not included" if to_hub else "no OUT given: write speed "
                     "unknown")
    elif speed.note:
        notes.append(f"disk speed of {speed.path} not measured: {speed.note}")
    fetch = sum(d.bytes for d in downloads.values())
    if fetch:
        notes.append(f"download time is not included ({format_size(fetch)} to download; it depends on the network)")
    if output.staging_dir is not None:
        notes.append("staged output is written twice (staging, then OUT) and read back once")
    files = len(pending) + sum(1 for a in aux_files(plan) if a.name not in committed)
    # Every commit rewrites the manifest (atomically), as do the start and the end of the run.
    write = output.total_bytes - output.committed_bytes - output.manifest_bytes
    manifests = output.manifest_bytes * (files + 2)
    return TimeEstimate(
        read_bytes=read_bytes,
        write_bytes=write * (2 if output.staging_dir is not None else 1) + manifests,
        verify_bytes=sum(d.verify_bytes for d in downloads.values()),
        rehash_bytes=sum(committed.values()),
        read_bytes_per_s=read_speed,
        write_bytes_per_s=write_speed,
        download_bytes=fetch,
        notes=tuple(notes),
        compute=tuple(compute),
        # The last shard is fsynced after its last tensor is computed: that flush overlaps nothing.
        tail_bytes=pending[-1].file_size if pending else 0,
        shared_cores=cores_are_shared(),
    )


# The engine's threads that stay busy through a merge: two compute workers and the writer (see executor.py).
ENGINE_BUSY_THREADS = 3


def cores_are_shared() -> bool:
    """True when this process may use no more cores than the engine keeps busy, so compute and disk work (page
    cache copies, sha256, writes) compete for them rather than overlap."""
    return usable_cores() <= ENGINE_BUSY_THREADS


def _read_share(spec: MethodSpec, tp: TensorPlan) -> int:
    """Input bytes the engine reads for ``tp`` (computed by ``spec``): its inputs, or its share of them where one
    computation serves several tensors (a LoRA module's A and B: the unit that computes the pair reads them, its
    sibling nothing)."""
    shared = spec.whole_cost.shared_by if spec.whole_cost is not None else 1
    return sum(i.end - i.start for i in tp.inputs) // shared


def _input_read_speed(plan: Plan, probe_bytes: int) -> float | None:
    """Cold read speed of the largest input file that is on disk now (``None`` if none is)."""
    if probe_bytes <= 0:
        return None
    files = [(size, Path(plan.model_dirs[model]) / name) for model, entries in plan.inputs.items()
             for name, size, _ in entries]
    for _, path in sorted(files, key=lambda f: -f[0]):
        if path.is_file():
            return probe_file_read(path, probe_bytes)
    return None


def estimate_config(
    config_text: str,
    options: PlanOptions,
    settings: RunSettings,
    *,
    source: str = "config",
    out_dir: str | os.PathLike[str] | None = None,
    measuring: Measuring | None = None,
    fresh_process: bool = False,
    planner: Callable[[], Prepared] | None = None,
    passes: PassMakers = PassMakers(),
) -> Estimate:
    """Validate ``config_text`` fully (config, every input's config.json and headers) and :func:`estimate` it.

    ``fresh_process`` says this process was started for this estimate, like the merge will be (``resumerge
    plan``): its age then measures the merge's start-up, imports included; otherwise only planning is counted
    (a notebook that merges in its own, already warm, process). Raises what
    :func:`resumerge.merge.engine.session.prepare` raises for an invalid merge (exit 2 errors); a merge that is valid
    but does not fit is not an error: see
    :attr:`Estimate.reasons`. ``out_dir`` may be an ``hf://`` target: the output's local disk is then its staging.
    The compute estimate times the methods with ``settings.num_threads`` torch threads, as the run will.
    A fresh process that plans a merge config on a CPU of several cores imports torch and times the sample in a
    helper process started before planning (:class:`~resumerge.analyses.estimate.torchside.TorchProcess`), so the import
    overlaps planning; it is killed on the way out, a refusal included. ``planner`` plans a config of another kind
    than a merge config (:mod:`resumerge.api` passes MoE upcycling's, which skips the prompt forward pass); None
    plans ``config_text`` as a merge config. ``measuring`` as for :func:`estimate` (its start-up is measured here);
    ``passes`` gives the estimates of the run's passes besides the merge from the plan (:class:`PassMakers`).
    """
    started = time.time()
    from resumerge.config.merge_config import load_config_text
    from resumerge.merge.engine.devices import is_gpu, set_torch_threads
    from resumerge.merge.engine.session import prepare

    set_torch_threads(settings.num_threads)
    # A run's process is fresh too: the helper's import, made while this process plans on another core, takes what
    # the run's will (a process that already holds torch, or computes on a GPU, keeps the work here; so does one
    # core, where the import could only take turns with planning and its seconds would count planning's too).
    apart = (fresh_process and planner is None and not torch_loaded() and not is_gpu(options.device)
             and usable_cores() > 1)
    # One pause over the planning and the estimate (the plan's millions of objects are never garbage while they are
    # made and walked); a fresh process keeps them, in the Estimate it prints, until it ends: frozen, not collected.
    with TorchProcess(settings.num_threads) if apart else TorchHere() as side, collector_paused(freeze=fresh_process):
        if planner is not None:
            prepared = planner()
        else:
            config = load_config_text(config_text, source=source)
            prepared = prepare(config, options, state=settings.state, cache_dir=settings.cache_dir)
        plan, inputs = prepared.plan, prepared.opened()
        if fresh_process:
            started = psutil.Process().create_time()
        startup = max(0.0, time.time() - started)
        # A run imports torch after its planning: its start-up is planning plus the import.
        imported = side.facts().import_seconds
        to_hub = out_dir is not None and is_hub_target(os.fspath(out_dir))
        measured = replace(measuring or Measuring(), startup=Startup(startup + imported, imported))
        return estimate(prepared, config_text, settings, out_dir=None if to_hub else out_dir,
                        measuring=measured, to_hub=to_hub, torch_side=side, passes=passes.of(plan, inputs))

"""What a merge costs, as frozen values: the result of an estimate and its JSON form (``resumerge plan --json``).

Computed by :mod:`resumerge.analyses.estimate.estimate`; read by the CLI's rendering and by notebooks through
:func:`resumerge.api.estimate`. The JSON document, schema 1::

    schema            1
    method, tensors, layers, shards (file names), output_bytes (shards only), config_donor, tokenizer_donor,
    fingerprint       the plan summary, as before estimates existed
    verdict           "fits" | "will not fit"
    fits              bool (exit code 0 / 2)
    reasons           [str]  one line each: what does not fit and what to change; [] when it fits
    notes             [str]  things worth knowing that do not decide the verdict (the plan's own first: what it
                             copied unchanged, dropped or renumbered, e.g. an MTP layer)
    output            {dir, shard_bytes, aux_bytes, manifest_bytes, total_bytes, largest_shard_bytes,
                       committed_bytes, needed_bytes, staging_dir, staging_bytes}
    download          {bytes, verify_bytes, cached_bytes, models: {key: {repo, commit, bytes, verify_bytes,
                       cached_bytes}}}  (only the hub files chosen for download)
    input_files       [{model, file, size, needed, how ("download" | "stream" | "cached"), reason, fetch_bytes}]
    memory            {budget, budget_source ("--max-memory" | "default"), machine_bytes, baseline_bytes,
                       counted_baseline_bytes, working_set_bytes, prepass_bytes, prepass_beside,
                       first_pass_bytes, first_pass_baseline_bytes, peak_bytes,
                       largest_unit_bytes,
                       smallest_budget}
    disks             [{path, roles, free_bytes, needed_bytes, fits}]  one per filesystem
    time              {seconds | null, startup_seconds, prepass_seconds, prepass_beside, prepass_cpu_seconds,
                       cores_available | null, first_pass_seconds, disk_seconds | null,
                       compute_seconds,
                       tail_seconds,
                       shared_cores,
                       read_bytes, write_bytes, verify_bytes, rehash_bytes, tail_bytes, read_bytes_per_s,
                       write_bytes_per_s, download_bytes, notes: [str],
                       compute: [{method, dtype, device, tensors, elements, sample_elements, sample_bytes,
                                  seconds_per_element | null, seconds_per_call, seconds | null, threads,
                                  synthetic, note, measure_seconds, whole, at_once}]}
                      compute: one entry per (method, dtype, flags) group of pending tensors

    hf_output         {output_bytes, largest_file, max_disk, staging_bytes}  local disk an hf:// OUT needs
    network           null (no hub input to fetch, no hf:// OUT) or {down_bytes, up_bytes, down_bytes_per_s,
                       up_bytes_per_s (null: unknown), source ("--bandwidth" | "measured"), down_seconds,
                       up_seconds, local_seconds, startup_seconds, import_seconds (torch's, after the first
                       bytes move), transfer_cpu_seconds (the transfers' CPU here), cores, seconds (pipelined
                       wall; null: a rate is unknown), bound ("download" | "upload" | "compute" | null), note}
                       (resumerge/analyses/estimate/network.py)
    formats           {inputs: {MODEL: {format, roles}}, output: {format, roles}}: each stored format ("plain", or
                       the quantized formats' names) and its stored tensors per role {weight, companion, other}
                       (resumerge/merge/plan/roles.py)
    filters           [{yaml_path, pattern, tensors}]: each ``filter:`` of the config the planner consulted and how many
                       output tensors of its scope it matched (resumerge/merge/plan/filters.py)
    first_pass        null, or the pass the run's process makes before the merge (--imatrix-texts' importance
                       matrix pass): {what, tokens, read_bytes, merge_share, write_bytes, state_bytes, held_bytes,
                       forward_seconds, baseline_bytes, seconds, peak_bytes, smallest_budget} (its bytes also in
                       memory.first_pass_bytes, its state dir's in disks; its smallest budget in
                       memory.smallest_budget, its peak in memory.peak_bytes where it is the run's)
    accounting        {tensors, merged, copied, renumbered, dropped, dropped_by_reason: {reason: n}, models: {key:
                       the same without models}} or null: what became of every input tensor
                       (resumerge/merge/plan/accounting.py)

All sizes are bytes, speeds bytes per second, figures rounded to whole numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from resumerge.analyses.estimate.computegroup import ComputeGroup
from resumerge.analyses.estimate.firstpass import FirstPass
from resumerge.analyses.estimate.network import NetworkEstimate
from resumerge.analyses.estimate.sessions import SessionPlan, hub_commits
from resumerge.machine.memory import format_size, smallest_budget_for
from resumerge.machine.memory.sizes import format_duration
from resumerge.merge.engine.hubdisk import HubDiskNeed
from resumerge.merge.plan.fetching import FileFetch, fetch_summary
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.roles import formats_line, formats_report, quantized

SCHEMA = 1
FITS = "fits"
WILL_NOT_FIT = "will not fit"


@dataclass(frozen=True)
class OutputSize:
    """Bytes the output directory will hold, and what is still to be written there."""

    dir: str | None
    shard_bytes: int
    aux_bytes: int
    manifest_bytes: int
    largest_shard_bytes: int
    committed_bytes: int
    staging_dir: str | None
    staging_bytes: int

    @property
    def total_bytes(self) -> int:
        """Everything in OUT once finished: shards, side files and the manifest."""
        return self.shard_bytes + self.aux_bytes + self.manifest_bytes

    @property
    def needed_bytes(self) -> int:
        """Free space OUT's disk needs now: what is not committed yet, plus the manifest's atomic rewrite."""
        return self.total_bytes - self.committed_bytes + self.manifest_bytes


@dataclass(frozen=True)
class ModelDownload:
    """One hub input: bytes still to fetch, cached but never verified (to hash), and cached and verified."""

    repo: str
    commit: str
    bytes: int
    verify_bytes: int
    cached_bytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak resident memory of the merge process: ``baseline`` (interpreter, torch, resumerge, what the run holds
    beside its units: :func:`resumerge.merge.engine.footprint.run_baseline`) plus the working set. The budget counts the
    same: the process's whole resident set; ``counted_baseline_bytes`` (schema 1) equals ``baseline_bytes``.

    ``working_set_bytes`` is the largest sum of unit estimates (:func:`resumerge.merge.plan.workunits.estimate_bytes`)
    in flight at once — :data:`CONCURRENCY` consecutive units, a row-chunked tensor alone — capped at the room the
    budget leaves; ``smallest_budget`` is the least ``--max-memory`` under which every unit can run, the figure the
    run's own refusal names (:func:`resumerge.merge.engine.footprint.smallest_run_budget`).
    """

    budget: int
    budget_source: str
    machine_bytes: int
    baseline_bytes: int
    counted_baseline_bytes: int
    working_set_bytes: int
    largest_unit_bytes: int
    smallest_budget: int
    # The RSS at its peak of a pass in a process of its own (a mergekit-moe config's prompt forward pass), which
    # runs beside the merge (``prepass_beside``) or before it; 0 when there is none.
    prepass_bytes: int = 0
    prepass_beside: bool = False
    # What a pass the run's own process makes before the merge holds beyond its baseline, and that baseline (the
    # run's process with the pass's modules imported: :class:`FirstPass`; 0: the merge's).
    first_pass_bytes: int = 0
    first_pass_baseline_bytes: int = 0
    # The merge's baseline after that pass, in the process it leaves (its modules, the GGUF encoders' kernels; 0: the
    # merge's own).
    first_pass_merge_baseline_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """The expected peak RSS of the run's processes together: the merge's, with the pass's beside it or
        before it (the run's process then holding its baseline). ``plan`` says "will not fit" when it is over the
        budget: the verdict and the printed peak are one figure."""
        return self._peak(self.baseline_bytes)

    @property
    def counted_peak_bytes(self) -> int:
        """:attr:`peak_bytes` (the budget counts the whole process; kept for callers of the earlier split)."""
        return self.peak_bytes

    def over_budget(self) -> str | None:
        """Why the run will not fit when :attr:`peak_bytes` is over the budget (with the ``--max-memory`` that holds
        it), else None."""
        if self.peak_bytes <= self.budget:
            return None
        needed = max(self.smallest_budget, smallest_budget_for(self.peak_bytes))
        return (f"memory: the run's peak, about {format_size(self.peak_bytes)}, is over the "
                f"{format_size(self.budget)} budget — rerun with --max-memory {format_size(needed, compact=True)} "
                "or more")

    def _peak(self, baseline: int) -> int:
        working = (self.working_set_bytes + self.prepass_bytes if self.prepass_beside
                   else max(self.working_set_bytes, self.prepass_bytes))
        merge = max(baseline, self.first_pass_merge_baseline_bytes) + working
        if not self.first_pass_bytes:
            return merge
        return max(merge, (self.first_pass_baseline_bytes or baseline) + self.first_pass_bytes)


# After the pass answers, the run writes and commits the routers' shard (the plan's last, 64 KB for the bench),
# then the output's small files, and exits: 0.3-0.4 s measured on the bench's 2-core machine.
PASS_FINISH_SECONDS = 0.4


@dataclass(frozen=True)
class DiskNeed:
    """One filesystem: the roles it plays (output, state, staging, hub cache), its free space and what they need."""

    path: str
    roles: tuple[str, ...]
    free_bytes: int
    needed_bytes: int

    @property
    def fits(self) -> bool:
        """Whether the needs fit the free space."""
        return self.needed_bytes <= self.free_bytes


@dataclass(frozen=True)
class TimeEstimate:
    """Wall time: disk work (reads at the inputs' measured speed, writes at OUT's) overlapped with the methods'
    compute (measured on samples, see :mod:`resumerge.analyses.estimate.compute`); downloads excluded.

    The engine reads and computes in worker threads while a writer thread streams finished tensors to disk and
    commits shards, so with cores to spare compute and disk work overlap and the slower of the two sets the pace.
    With no more cores than the engine's busy threads (two workers and the writer: ``shared_cores``), reading
    from the page cache, hashing and writing take CPU from the methods, and the two add up instead: on the
    project's 2-core machine the overlapped figure came to 0.40–0.85× of the measured wall time for 19 of the
    20 methods at 1.75 GB, the sum to 0.60–1.52× (median 0.82×; bench/RESULTS.md). What never overlaps is the commit
    of the last shard: its bytes sit in the page cache until its fsync, which only starts after its last tensor
    is computed (``tail_bytes``, written at OUT's speed after everything else).
    """

    read_bytes: int
    write_bytes: int
    verify_bytes: int
    rehash_bytes: int
    read_bytes_per_s: float | None
    write_bytes_per_s: float | None
    download_bytes: int
    startup_seconds: float = 0.0
    notes: tuple[str, ...] = ()
    compute: tuple[ComputeGroup, ...] = ()
    tail_bytes: int = 0
    shared_cores: bool = False
    # A pass in a process of its own (a mergekit-moe config's prompt forward pass), beside the merge or before it.
    prepass_seconds: float = 0.0
    prepass_beside: bool = False
    # Its CPU seconds, and the cores the run's two processes may expect to share (the machine's, less what other
    # processes used while the pass was probed; None: not measured, no contention counted).
    prepass_cpu_seconds: float = 0.0
    cores_available: float | None = None
    # A pass the run's own process makes before the merge (:class:`FirstPass`), after the start-up.
    first_pass_seconds: float = 0.0

    @property
    def disk_seconds(self) -> float | None:
        """Seconds of disk work (reads, verification, re-hashing, writes); None when a speed is unknown."""
        if self.read_bytes_per_s is None or self.write_bytes_per_s is None:
            return None
        reads = self.read_bytes + self.verify_bytes + self.rehash_bytes
        return reads / self.read_bytes_per_s + self.write_bytes / self.write_bytes_per_s

    @property
    def compute_seconds(self) -> float:
        """Seconds the methods compute, summed over the measured groups (0 when none was measured)."""
        return sum(g.seconds or 0.0 for g in self.compute)

    @property
    def tail_seconds(self) -> float:
        """The last shard's flush, after all computation (0 when OUT's write speed is unknown)."""
        return self.tail_bytes / self.write_bytes_per_s if self.write_bytes_per_s else 0.0

    @property
    def seconds(self) -> float | None:
        """Expected seconds: start-up (imports and planning, as measured here), then disk work and compute
        (overlapped, or added where they share the cores), then the last shard's flush; ``None`` when a disk speed
        could not be measured. A pass in a process of its own starts with the run (its seconds count from there):
        beside the merge, the run ends when both have; before it, the merge starts once the pass and the
        start-up have both ended. A pass of the run's own process before the merge (:class:`FirstPass`) adds
        its seconds."""
        disk = self.disk_seconds
        if disk is None:
            return None
        tail = min(self.tail_seconds, disk)
        overlapped = max(disk - tail, self.compute_seconds) + tail
        merge = (disk + self.compute_seconds if self.shared_cores else overlapped) + self.first_pass_seconds
        if self.prepass_beside:
            return max(self.startup_seconds + merge, self.prepass_seconds + PASS_FINISH_SECONDS,
                       self._shared(self.startup_seconds + merge) + PASS_FINISH_SECONDS)
        return max(self.startup_seconds, self.prepass_seconds, self._shared(self.startup_seconds)) + merge

    def _shared(self, merge_seconds: float) -> float:
        """The seconds both processes need when they run at once on the cores left to them: the merge's work
        (counted as CPU: page-cache copies, hashing and writes are) and the pass's CPU, over those cores. On the
        bench's 2 shared cores the two processes got 1.1-1.3 cores between them and this bounded the run."""
        if not self.cores_available or not self.prepass_cpu_seconds:
            return 0.0
        return (merge_seconds + self.prepass_cpu_seconds) / self.cores_available


@dataclass(frozen=True)
class Estimate:
    """The plan with its costs on this machine and the verdict. See the module docstring for the JSON form."""

    plan: Plan
    output: OutputSize
    downloads: Mapping[str, ModelDownload]
    memory: MemoryEstimate
    disks: tuple[DiskNeed, ...]
    time: TimeEstimate
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    fetch: tuple[FileFetch, ...] = ()  # per hub weight file: download, stream or cached, and its bytes
    hf_output: HubDiskNeed | None = None  # the local disk an hf:// OUT would need
    network: NetworkEstimate | None = None  # bytes each way at the link's rates, when the merge uses the network
    shard_choice: str | None = None  # why the output shards have their size, when no --out-shard-size was given
    session: SessionPlan | None = None  # the merge in notebook sessions of a given length (plan --session)
    first_pass: FirstPass | None = None  # a pass the run's process makes before the merge (--imatrix-texts')

    def __repr__(self) -> str:
        """The text ``resumerge plan`` prints (:func:`estimate_text`), not the whole plan: a notebook cell ending
        in ``api.estimate(...)`` showed 257 KB."""
        return estimate_text(self)

    @property
    def fits(self) -> bool:
        """True when nothing stands in the way (no reasons)."""
        return not self.reasons

    @property
    def verdict(self) -> str:
        """``"fits"`` or ``"will not fit"``."""
        return FITS if self.fits else WILL_NOT_FIT

    @property
    def hub_commits(self) -> int | None:
        """Commits an ``hf://`` OUT gets under the default pacing over the estimated wall (None: not to the hub)."""
        if self.network is None or not self.network.up_bytes:
            return None
        return hub_commits(len(self.plan.shards), self.network.seconds)

    def sessions_of(self, length: float) -> SessionPlan:
        """This merge in sessions of ``length`` seconds: its wall from the network estimate when it uses the
        network, else from the time estimate."""
        if self.network is not None:
            return SessionPlan(length, self.network.seconds, self.network.startup_seconds, "network estimate")
        return SessionPlan(length, self.time.seconds, self.time.startup_seconds, "time estimate")

    @property
    def download_bytes(self) -> int:
        """Bytes still to download from the hub."""
        return sum(d.bytes for d in self.downloads.values())

    def to_json(self) -> dict[str, Any]:
        """The machine-readable document printed by ``resumerge plan --json`` (schema in the module docstring)."""
        plan, t = self.plan, self.time
        timing = {k: v for k, v in asdict(t).items() if not k.endswith("_per_s")} | {
            "seconds": None if t.seconds is None else round(t.seconds, 1),
            "startup_seconds": round(t.startup_seconds, 1),
            "prepass_seconds": round(t.prepass_seconds, 1),
            "disk_seconds": None if t.disk_seconds is None else round(t.disk_seconds, 2),
            "compute_seconds": round(t.compute_seconds, 2),
            "tail_seconds": round(t.tail_seconds, 2),
            "shared_cores": t.shared_cores,
            "compute": [g.to_json() for g in t.compute],
            "read_bytes_per_s": None if t.read_bytes_per_s is None else round(t.read_bytes_per_s),
            "write_bytes_per_s": None if t.write_bytes_per_s is None else round(t.write_bytes_per_s),
            "notes": list(t.notes),
        }
        return {
            "schema": SCHEMA,
            "method": plan.method,
            "tensors": len(plan.tensors),
            "layers": plan.num_layers,
            "shards": [s.name for s in plan.shards],
            "shard_size": {"bytes": plan.options.out_shard_size, "why": self.shard_choice or "--out-shard-size"},
            "output_bytes": plan.total_bytes,
            "config_donor": plan.donor,
            "tokenizer_donor": plan.tokenizer_donor,
            "fingerprint": plan.fingerprint,
            "verdict": self.verdict,
            "fits": self.fits,
            "reasons": list(self.reasons),
            "notes": [*plan.notes, *self.notes],
            "output": asdict(self.output) | {"total_bytes": self.output.total_bytes,
                                             "needed_bytes": self.output.needed_bytes},
            "download": {
                "bytes": self.download_bytes,
                "verify_bytes": sum(d.verify_bytes for d in self.downloads.values()),
                "cached_bytes": sum(d.cached_bytes for d in self.downloads.values()),
                "models": {k: asdict(d) for k, d in sorted(self.downloads.items())},
            },
            "input_files": [asdict(c) | {"fetch_bytes": c.fetch_bytes} for c in self.fetch],
            "memory": asdict(self.memory) | {"peak_bytes": self.memory.peak_bytes},
            "disks": [asdict(d) | {"roles": list(d.roles), "fits": d.fits} for d in self.disks],
            "time": timing,
            "hf_output": None if self.hf_output is None else self.hf_output.to_json(),
            "network": None if self.network is None else self.network.to_json() | {"commits": self.hub_commits},
            "sessions": None if self.session is None else self.session.to_json(),
            "first_pass": None if self.first_pass is None else self.first_pass.to_json(t.first_pass_seconds),
            "formats": formats_report(plan),
            "filters": [f.to_json() for f in plan.filters],
            "accounting": None if plan.accounting is None else plan.accounting.to_json(),
        }


# -- the text ``plan`` prints (the CLI draws it with its styles; an Estimate shows it as its repr) -------------

# What a line is, for the CLI's styles: the headline, a labelled fact, a labelled note, the verdict, a reason.
HEAD, FIELD, NOTE, FITS, UNFIT, REASON = "head", "field", "note", "fits", "unfit", "reason"


@dataclass(frozen=True)
class Line:
    """One line of the estimate's text: ``label`` (empty for the headline, the verdict and its reasons), ``text``
    and its ``kind``."""

    kind: str
    text: str
    label: str = ""

    def plain(self) -> str:
        """The line as plain text."""
        if self.kind == REASON:
            return f"  - {self.text}"
        return f"{self.label:<13}{self.text}" if self.label else self.text


def estimate_lines(estimate: Estimate) -> list[Line]:
    """Every line of ``plan``'s text for ``estimate``, in order."""
    plan, output, memory = estimate.plan, estimate.output, estimate.memory
    lines = [Line(HEAD, plan.headline())]

    def fact(label: str, text: str) -> None:
        lines.append(Line(FIELD, text, label))

    committed = f"; {format_size(output.committed_bytes)} already committed" if output.committed_bytes else ""
    fact("output", f"{format_size(output.total_bytes)} ({len(plan.shards)} shard(s), the largest "
         f"{format_size(output.largest_shard_bytes)}){committed}" + (f" in {output.dir}" if output.dir else ""))
    formats = formats_report(plan)
    if quantized(formats):  # a plain merge's summary is unchanged
        fact("formats", formats_line(formats))
    if plan.accounting is not None:
        fact("inputs", plan.accounting.summary())
    for f in plan.filters:
        fact("filter", f"{f.yaml_path} {f.pattern!r}: {f.tensors} tensor(s)")
    files = plan.container.files_fact()  # a GGUF output is one file, or gguf-split's files: no shard size
    if files is not None:
        fact("shards", files)
    elif estimate.shard_choice:
        fact("shards", f"up to {format_size(plan.options.out_shard_size)} each ({estimate.shard_choice})")
    if output.staging_dir:
        fact("staging", f"{format_size(output.staging_bytes)} at a time in {output.staging_dir}")
    if estimate.downloads:
        cached = sum(d.cached_bytes + d.verify_bytes for d in estimate.downloads.values())
        fact("download", f"{format_size(estimate.download_bytes)} from the hub ({format_size(cached)} already cached)")
    else:
        fact("download", "nothing (local models)")
    summary = fetch_summary(estimate.fetch)
    if summary:
        fact("fetch", summary)
    for c in estimate.fetch:
        fact("input", f"{c.model}/{c.file}: {c.how} {format_size(c.fetch_bytes)} of {format_size(c.size)} "
             f"({c.reason})")
    fact("memory", memory_line(memory))
    if estimate.time.prepass_seconds or memory.prepass_bytes:
        when = "beside the merge" if memory.prepass_beside else "first"
        fact("pass", f"the prompt forward pass {when}, in a process of its own: about "
             f"{format_duration(estimate.time.prepass_seconds)}, {format_size(memory.prepass_bytes)} in that process")
    if estimate.first_pass is not None:
        fact("pass", estimate.first_pass.line(estimate.time.first_pass_seconds))
    for disk in estimate.disks:
        mark = "" if disk.fits else " -- too small"
        fact("disk", f"{' + '.join(disk.roles)}: needs {format_size(disk.needed_bytes)}, "
             f"{format_size(disk.free_bytes)} free on {disk.path}{mark}")
    if estimate.hf_output is not None:
        fact("hf://", estimate.hf_output.line())
    fact("time", time_text(estimate))
    if estimate.network is not None:
        fact("network", estimate.network.line())
    if estimate.hub_commits is not None:
        fact("commits", f"about {estimate.hub_commits} into the repo, one per shard as it is uploaded, paced under "
             "the hub's 128 an hour")
    if estimate.session is not None:
        fact("sessions", estimate.session.line())
    lines += [Line(NOTE, note, "note") for note in (*plan.notes, *estimate.notes, *estimate.time.notes)]
    if estimate.fits:
        return [*lines, Line(FITS, "fits")]
    return [*lines, Line(UNFIT, "will not fit"), *(Line(REASON, reason) for reason in estimate.reasons)]


def estimate_text(estimate: Estimate) -> str:
    """``plan``'s text for ``estimate``, plain."""
    return "\n".join(line.plain() for line in estimate_lines(estimate))


def memory_line(memory: MemoryEstimate) -> str:
    """``plan``'s memory line, in words that agree with its verdict (which compares this very peak with the budget),
    with the smallest budget the merge works under (the figure ``run`` names when it refuses a smaller one)."""
    peak = (f"peak about {format_size(memory.peak_bytes)} ({format_size(memory.baseline_bytes)} process + "
            f"{format_size(memory.working_set_bytes)} working set)")
    smallest = f"the smallest budget that works is {format_size(memory.smallest_budget)}"
    budget = f"{format_size(memory.budget)} budget ({memory.budget_source})"
    if memory.smallest_budget > memory.budget:
        return f"{peak}: {smallest}, more than the {budget}"
    named = f"; {smallest}" if memory.smallest_budget else ""  # 0: not found (an estimate made without it)
    if memory.peak_bytes > memory.budget:
        return f"{peak}: over the {budget}{named}"
    return f"{peak} under a {budget}{named}"


def time_text(estimate: Estimate) -> str:
    """``plan``'s time line: the total, what bounds it, and the disk's rates."""
    t = estimate.time
    compute = f"{format_duration(t.compute_seconds)} of compute" if t.compute else ""
    if t.seconds is None:
        return "unknown (disk speed not measured)" + (f"; {compute}" if compute else "")
    rates = []
    if t.read_bytes_per_s:
        rates.append(f"read {format_size(t.read_bytes + t.verify_bytes + t.rehash_bytes)} at "
                     f"{format_size(int(t.read_bytes_per_s))}/s")
    if t.write_bytes_per_s:
        rates.append(f"write {format_size(t.write_bytes)} at {format_size(int(t.write_bytes_per_s))}/s")
    if not compute:
        return f"about {format_duration(t.seconds)} of disk work: {', '.join(rates)}"
    # With cores to spare compute and disk work overlap, so the total is not their sum: say both, and what bounds
    # it; on a machine whose cores the engine's threads fill, they add up (see TimeEstimate).
    disk = t.disk_seconds or 0.0
    bound = "compute-bound" if t.compute_seconds > disk else "disk-bound"
    joined = "plus (they share this machine's cores)" if t.shared_cores else "overlapped with"
    return (f"about {format_duration(t.seconds)} ({bound}): {compute} {joined} {format_duration(disk)} of disk work "
            f"({', '.join(rates)})")

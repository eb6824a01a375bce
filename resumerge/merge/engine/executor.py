"""Execute a plan: compute every pending tensor, stream it into its shard, commit shards and side files.

Three stages overlap: worker threads read inputs and run the merge method (torch releases the GIL), the
calling thread hands finished tensors over in order (shards as :func:`~resumerge.merge.plan.workorder.compute_order`
puts them: as their input bytes arrive; each shard's tensors in its data order), and one writer thread
(:mod:`resumerge.merge.engine.writer`) streams them to disk, hashes them, and publishes each finished file through the
sink; the commit protocol's ledger rows and manifest are
:class:`~resumerge.merge.store.journal_commit.CommitJournal`'s — so the fsync of one shard overlaps the
computation of the next. Inputs may still be arriving (hub downloads read as they land): a shard is committed only
once every input file it read is checked — a folder OUT waits before publishing it, an hf:// OUT uploads it at once and
commits it after (:meth:`~resumerge.merge.store.sink.OutputSink.commit_when`). A stop request is honoured between
units (a tensor, or a group of small ones: :mod:`resumerge.merge.engine.unitgroup`): the unfinished shard's temp file is
deleted and everything committed stays committed; files a sink has uploaded but not committed yet (a hub repo's) get
one last, bounded commit first (:mod:`resumerge.merge.engine.interrupts`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from resumerge.inputs.kernels import serial_kernels
from resumerge.inputs.source import InputSources
from resumerge.machine.memory import MemoryGovernor, Reservation, released_on_error
from resumerge.machine.memory.collector import alive_frozen
from resumerge.machine.torch_import import torch
from resumerge.merge.engine import cpupriority
from resumerge.merge.engine.bufferpool import BufferPool
from resumerge.merge.engine.compute import Stored, TensorCompute
from resumerge.merge.engine.devices import is_gpu
from resumerge.merge.engine.groupscales import GroupScales
from resumerge.merge.engine.inflight import CONCURRENCY as CONCURRENCY
from resumerge.merge.engine.inflight import HELD_PER_WORKER, InFlight
from resumerge.merge.engine.reporting import Reporter as Reporter
from resumerge.merge.engine.reporting import Stopped as Stopped
from resumerge.merge.engine.unitgroup import UnitGroup, group_bytes, joins_others
from resumerge.merge.engine.workspace import Workspace, Workspaces, workspace_bytes
from resumerge.merge.engine.writer import InPlace, Item, Journal, Writer
from resumerge.merge.methods.registry import MethodSpec
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan.fetching import read_order
from resumerge.merge.plan.merge_plan import Plan, ShardPlan, TensorPlan
from resumerge.merge.plan.unitkey import sizing_key
from resumerge.merge.plan.workorder import compute_order
from resumerge.merge.plan.workunits import (
    PASSES,
    ROWS,
    WHOLE,
    aligned_rows,
    collects_sibling,
    estimate_bytes,
    floor_rows,
    held_bytes,
    row_stream,
    stream_rows,
    unit_bytes,
    unit_mode,
)
from resumerge.merge.store.shardwriter import start_hashing
from resumerge.merge.store.sink import OutputSink

# The journal (the ledger, sqlite-utils) is the journaling process's: a cluster node's worker runs this pipeline
if TYPE_CHECKING:  # and journals nothing, so its start (before its first shard) never imports it.
    from resumerge.merge.store.ledger import Ledger



def _elementwise(plan: Plan, tp: TensorPlan) -> bool:
    return plan.method_of(tp).elementwise


def _tensors_of(plan: Plan, shards: Iterable[ShardPlan],
                skipped: frozenset[str] = frozenset()) -> Iterator[tuple[ShardPlan, TensorPlan]]:
    """The tensors of ``shards`` to compute, in order: all but those ``skipped`` (in units a previous run kept)."""
    for shard in shards:
        for name in shard.tensors:
            if name not in skipped:
                yield shard, plan.tensors[name]


def _members(plan: Plan, done: Collection[str]) -> dict[str, tuple[ShardPlan, ...]]:
    """For each file that leads a computation (:meth:`~resumerge.outputs.containers.OutputContainer.lead`: every
    file, but in a GGUF release its first), the files it writes that are not ``done`` (none: all committed)."""
    members: dict[str, list[ShardPlan]] = {}
    for shard in plan.shards:
        group = members.setdefault(plan.container.lead(shard.name), [])
        if shard.name not in done:
            group.append(shard)
    return {lead: tuple(group) for lead, group in members.items()}


def _skipped(plan: Plan, members: Mapping[str, Sequence[ShardPlan]],
             kept: Mapping[str, frozenset[int]]) -> frozenset[str]:
    """The tensors not computed again: in a unit a previous run kept of every file still pending that holds
    them."""
    skipped: set[str] = set()
    for group in members.values():
        found: set[str] | None = None
        for shard in group:
            kept_here = {n for i, (_, _, names) in enumerate(plan.file_units(shard))
                         if i in kept.get(shard.name, ()) for n in names}
            found = kept_here if found is None else found & kept_here
        skipped |= found or set()
    return frozenset(skipped)


class _SizedUnits:
    """Each tensor's mode and admitted estimate (:func:`unit_mode`, :func:`unit_bytes`) under one run's budget,
    device and kernels' threads, worked out once per class of tensors (:func:`sizing_key`: every estimate of
    :mod:`resumerge.merge.plan.workunits` reads nothing else) and whether its inputs read again cheaply. A 90k-tensor
    run asked them of every tensor, two or three estimates each (180k of its 240k estimates, with the smallest
    budget's 60k); its tensors fall into 30k classes (per-layer weights), a model's usually into a few dozen."""

    def __init__(self, budget: int | None, device: str, serial: bool) -> None:
        self.budget, self.device, self.serial = budget, device, serial
        self._known: dict[tuple[Hashable, bool], tuple[str, int]] = {}

    def __call__(self, tp: TensorPlan, method: MethodSpec, rereadable: bool) -> tuple[str, int]:
        try:
            key = (sizing_key(tp), rereadable)
            found = self._known.get(key)
        except TypeError:  # a parameter value that cannot be hashed (a list): sized on its own
            key, found = None, None
        if found is None:
            mode = unit_mode(tp, method, self.budget, self.device, rereadable=rereadable, serial=self.serial)
            found = mode, unit_bytes(tp, method, mode)
            if key is not None:
                self._known[key] = found
        return found


def kept_units(ledger: Ledger, done: Collection[str]) -> dict[str, frozenset[int]]:
    """For each file written in place (whose units the ledger journals) and not ``done``: the units already
    written, which :func:`~resumerge.merge.engine.reconcile.reconcile` re-hashed and kept."""
    kept: dict[str, set[int]] = {}
    for row in ledger.units():
        if row.file not in done:
            kept.setdefault(row.file, set())
            if row.status == "done":
                kept[row.file].add(row.index)
    return {name: frozenset(indices) for name, indices in kept.items()}


class _Pipeline:
    """The calling thread's side: admit units, compute them on the pool, hand results to the writer in order."""

    def __init__(self, plan: Plan, sources: InputSources, writer: Writer, governor: MemoryGovernor | None,
                 workers: int, should_stop: Callable[[], bool], resources: Resources,
                 gpu: MemoryGovernor | None = None, yield_cpu: bool = False) -> None:
        """The workspaces share the ``writer``'s pool (:attr:`Writer.pool`): the results it writes from their
        buffers come back to them."""
        self.plan, self.writer, self.governor, self.workers = plan, writer, governor, workers
        self.resources = resources
        self.gpu = gpu
        self.should_stop = should_stop
        self.sources = sources
        # A thread for every group the line (InFlight) may hold, so that each group starts as it is submitted: the
        # line counts a group as computing from then on, and a group collecting its sibling's result
        # (collects_sibling) blocks its thread until that result comes. make_room starts a group while fewer than
        # HELD_PER_WORKER x workers are in the line, and a sibling-collecting one (a LoRA module's B, right after
        # its A) beside them at once: HELD_PER_WORKER x workers + 1 threads.
        self.pool = ThreadPoolExecutor(max_workers=HELD_PER_WORKER * workers + 1, thread_name_prefix="resumerge-merge",
                                       initializer=cpupriority.yield_to_transfers if yield_cpu else None)
        self.inflight: InFlight[UnitGroup, list[Stored]] = InFlight(workers, self._hand_over)
        # Each computation's decoded inputs and result buffer, reused by the next (see
        # resumerge.merge.engine.workspace): one per worker, as at most `workers` groups compute at once
        # (sibling-collecting groups compute nothing).
        self.workspaces = Workspaces(workspace_bytes(self._budget() if governor is not None else None, workers),
                                     workers, writer.pool)
        self.scales = GroupScales(plan)  # each fused group's largest magnitude, measured once

    def halted(self) -> bool:
        return self.should_stop() or self.writer.error is not None or not self.writer.is_alive()

    def limit(self) -> int:
        limit = min(self.workers, self.governor.in_flight_limit) if self.governor else self.workers
        return min(limit, self.gpu.in_flight_limit) if self.gpu else limit

    def run(self, work: Iterator[tuple[ShardPlan, TensorPlan]]) -> bool:
        """Process every unit of ``work``; returns False when stopped early."""
        # Whether the workers fill torch's threads: a setting of the run, fixed before the first unit.
        serial = torch.get_num_threads() <= self.workers
        # Where they do, a whole tensor's kernels run on its worker's thread alone too: methods that work block
        # by block issue thousands of small kernels, and each one split over torch's threads waits on a core
        # another worker holds (della: 580,000 context switches a merge, 3 s of 23). Decided by the run's
        # settings alone, never by the moment's memory: a whole-tensor sum's bits depend on the threads it is
        # split over, and a resumed run must compute every tensor as the first run would.
        alone = serial and not is_gpu(self.plan.options.device)
        budget = self._budget() if self.governor is not None else None
        most = group_bytes(budget)
        sized = _SizedUnits(budget, self.plan.options.device, serial)
        previous: TensorPlan | None = None
        pending: UnitGroup | None = None  # small whole units gathered, not launched yet
        for shard, planned in work:
            # A member of a group sharing one tensor-wide scale: the group measured first (once per run).
            tp = self.scales.scaled(planned, partial(self._amax, budget=budget, serial=serial, alone=alone))
            if tp is None:
                return False
            method = self.plan.method_of(tp)
            sibling, previous = collects_sibling(previous, tp, method), tp
            # Whether its inputs read again cheaply decides only between a stream's passes and rows: asked of
            # methods that stream alone (a walk over the tensor's reads).
            local = method.streamed is None or self._local(tp)
            mode, whole_estimate = sized(tp, method, local)
            stream = row_stream(tp, method, self.plan.options.device) if mode in (ROWS, PASSES) else None
            unit = TensorCompute(self.plan, tp, self.sources, self.resources, stream)
            # A unit collecting its sibling's result holds that result only; its sibling's estimate covers the work.
            estimate = tp.nbytes if sibling else whole_estimate
            shares = joins_others(method, whole=mode == WHOLE, sibling=sibling)
            if pending is not None and (mode == ROWS or not shares or not pending.takes(shard, estimate, most)):
                launched, pending = self._launch(pending, alone), None
                if not launched:
                    return False
            if mode == ROWS:
                if not self.flush() or not self._stream_rows(shard, tp, method, unit):
                    return False
                continue
            if pending is None:
                pending = UnitGroup(shard, alone=not shares, sibling=sibling)
            pending.add(unit, estimate)
        return (pending is None or self._launch(pending, alone)) and self.flush()

    def _amax(self, tp: TensorPlan, *, budget: int | None, serial: bool, alone: bool) -> float | None:
        """The largest magnitude of ``tp``'s merged value (a member of a group sharing one tensor-wide scale), merged
        as its own unit merges it (the same mode and kernels' threads) on this thread, admitted as that unit is;
        None when stopped first."""
        method, device = self.plan.method_of(tp), self.plan.options.device
        local = method.streamed is None or self._local(tp)
        mode = unit_mode(tp, method, budget, device, rereadable=local, serial=serial)
        stream = row_stream(tp, method, device) if mode in (ROWS, PASSES) else None
        # A ROWS unit is admitted chunk by chunk (a shared-scale format's chunk is all its rows), with what its
        # stream keeps across them.
        estimate = unit_bytes(tp, method, mode) if mode != ROWS else estimate_bytes(tp, method) + held_bytes(
            tp, method)
        admitted, reservation, on_gpu = self._admit_both(tp.name, estimate)
        if not admitted:
            return None
        try:
            with serial_kernels() if (stream is not None if mode == ROWS else alone) else nullcontext():
                return TensorCompute(self.plan, tp, self.sources, self.resources, stream).amax()
        finally:
            for each in (reservation, on_gpu):
                if each is not None:
                    each.release()

    def _launch(self, group: UnitGroup, alone: bool) -> bool:
        """Admit ``group`` and start computing it on the pool (PASSES units only where the workers fill torch's
        threads on the CPU: ``alone``, a stream's chunk kernels run serially, see resumerge.inputs.kernels); False
        when stopped first."""
        if not self.inflight.make_room(group.sibling, self.limit()):
            return False
        admitted, reservation, on_gpu = self._admit_both(group.units[0].tp.name, group.estimate)
        if not admitted:
            return False
        with released_on_error(reservation), released_on_error(on_gpu):
            future = self.pool.submit(self._compute, group, on_gpu, alone)
        self.inflight.add(group, future, reservation)
        return True

    def _compute(self, group: UnitGroup, on_gpu: Reservation | None, serial: bool) -> list[Stored]:
        """Compute ``group``'s tensors whole in order, their kernels on this thread alone when ``serial``, in a
        workspace unless the group only collects its sibling's result; their GPU reservation ends with the
        computation (the results are back on the host)."""
        try:
            lent: AbstractContextManager[Workspace | None] = (
                nullcontext(None) if group.sibling else self.workspaces.lend())
            with serial_kernels() if serial else nullcontext(), lent as workspace:
                return [unit.whole(workspace) for unit in group.units]
        finally:
            if on_gpu is not None:
                on_gpu.release()

    @staticmethod
    def _encode(encode: Callable[[], Stored], serial: bool) -> list[Stored]:
        """A streamed chunk's encoding (:meth:`~resumerge.merge.engine.compute.TensorCompute.rows_then`) on a worker,
        its kernels on that thread alone when ``serial`` (as its stream's run)."""
        with serial_kernels() if serial else nullcontext():
            return [encode()]

    def _local(self, tp: TensorPlan) -> bool:
        """Whether every input of ``tp`` reads again at local cost (a hub file streamed by range would be fetched
        again by each pass: such a tensor is computed whole unless it cannot fit)."""
        return all(self.sources.rereads_cheaply(r.model, r.file) for r in tp.reads())

    def _budget(self) -> int:
        assert self.governor is not None
        budget = _work_budget(self.governor, self.gpu)
        assert budget is not None
        return budget

    def _admit_both(self, what: str, estimate: int) -> tuple[bool, Reservation | None, Reservation | None]:
        """(admitted, host reservation, GPU reservation) of ``estimate`` bytes; nothing is held when not admitted
        (stopped) or when an admission raises."""
        admitted, host = self._admit(what, estimate, self.governor)
        if not admitted:
            return False, None, None
        with released_on_error(host):
            admitted, on_gpu = self._admit(what, estimate, self.gpu)
        if not admitted and host is not None:
            host.release()
        return admitted, host if admitted else None, on_gpu

    def _admit(self, what: str, estimate: int, pool: MemoryGovernor | None,
               held: bool = False) -> tuple[bool, Reservation | None]:
        """(admitted, reservation) of ``estimate`` bytes from ``pool``; the reservation is None without a governor,
        and admitted is False when stopped; ``held`` as in :meth:`MemoryGovernor.acquire`.

        While waiting, finished units are handed to the writer: their reservations are what frees the room.
        """
        if pool is None:
            return True, None
        # Units are sized against the whole budget: one the governor would admit alone over the headroom first
        # gets back what the idle workspaces hold (host memory only).
        make_room = self.workspaces.trim if pool is self.governor else None
        while True:
            try:
                return True, pool.acquire(estimate, timeout=0.05, what=what, make_room=make_room, held=held)
            except TimeoutError:
                if self.halted():
                    return False, None
                if self.inflight and not self.inflight.hand_over_oldest():
                    return False, None

    def _hand_over(self, group: UnitGroup, result: list[Stored], reservation: Reservation | None) -> bool:
        return self._put((group.shard, group.names, result, reservation))

    def flush(self) -> bool:
        return self.inflight.flush() and not self.halted()

    def _put(self, item: Item) -> bool:
        while not self.halted():
            try:
                self.writer.items.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        if item[3] is not None:
            item[3].release()
        return False

    def _stream_rows(self, shard: ShardPlan, tp: TensorPlan, method: MethodSpec, work: TensorCompute) -> bool:
        """Compute ``tp`` in row chunks sized to the current headroom: ``work``'s statistics passes, if any, then its
        output rows to the writer, every chunk admitted as it comes; False when stopped."""
        # What a stream keeps across its passes (sampled masks) is held from the first chunk to the last.
        held = work.held_bytes()
        admitted, reservation = self._admit(tp.name, held, self.governor, held=True) if held else (True, None)
        if not admitted:
            return False

        def observe(first: int, stop: int, reservation: Reservation | None, on_gpu: Reservation | None) -> bool:
            try:
                work.observe(pass_index, first, stop)
            finally:
                for each in (reservation, on_gpu):
                    if each is not None:
                        each.release()
            return not self.halted()

        def emit(first: int, stop: int, reservation: Reservation | None, on_gpu: Reservation | None) -> bool:
            try:
                with released_on_error(reservation):
                    tensor = work.rows(first, stop)
            finally:
                if on_gpu is not None:
                    on_gpu.release()
            return self._put((shard, (tp.name,), [tensor], reservation))

        # On the CPU a chunk's merge (a stream's next rows: in order, here) is cheap beside its encoding (a K-quant's
        # searches: 9 in 10 of a chunk's CPU), which depends on its rows alone: the workers encode the chunks while
        # this thread merges the next, and the line hands them to the writer in order, each with its reservation
        # (so a full budget waits for the oldest to be written, as for whole units). A quantized GGUF's embeddings
        # and head were encoded on this thread alone, the pool idle: 8 of a 2-layer bench merge's 28 CPU s on one
        # core (bench/bench_kquant_route.py). The same bytes: how a tensor is cut and where it is encoded never
        # change them.
        def emit_encoded(first: int, stop: int, reservation: Reservation | None, on_gpu: Reservation | None) -> bool:
            with released_on_error(reservation):
                if not self.inflight.make_room(False, self.limit()):
                    if reservation is not None:
                        reservation.release()
                    return False
                encode = work.rows_then(first, stop)
                future = self.pool.submit(self._encode, encode, work.stream is not None)
            self.inflight.add(UnitGroup(shard, alone=True, units=[work]), future, reservation)
            return not self.halted()

        pooled = tp.copy_of is None and self.gpu is None and not is_gpu(self.plan.options.device)

        try:
            # A stream's kernels are of chunk size: they run serially (see resumerge.inputs.kernels), as in PASSES.
            with serial_kernels() if work.stream is not None else nullcontext():
                pass_index = 0
                while work.wants(pass_index):
                    if not self._each_chunk(tp, method, observe):
                        return False
                    pass_index += 1
                return self._each_chunk(tp, method, emit_encoded if pooled else emit)
        finally:
            if reservation is not None:
                reservation.release()

    def _each_chunk(self, tp: TensorPlan, method: MethodSpec,
                    use: Callable[[int, int, Reservation | None, Reservation | None], bool]) -> bool:
        """Admit ``tp``'s rows chunk by chunk, first rows first, each sized to the current headroom, and hand each
        chunk's rows ``[first, stop)`` with its host and GPU reservations to ``use`` (which releases them or passes
        them on, and returns False to stop). False when stopped."""
        assert self.governor is not None
        total = tp.shape[0]
        row_estimate = max(1, estimate_bytes(tp, method, rows=1))
        most = stream_rows(tp, method)
        # Never thinner than the floor the smallest budget leaves room for: a trickle of one-row chunks, each admitted
        # alone over the headroom, was the slowest way to the same peak.
        floor = min(most, floor_rows(tp, method))
        first = 0
        while first < total:
            room = max(floor, self.governor.chunk_rows(row_estimate, total - first))
            rows = max(1, min(total - first, most, room))
            if self.gpu is not None:
                rows = max(1, min(rows, self.gpu.chunk_rows(row_estimate, total - first)))
            rows = aligned_rows(tp, rows, total - first)
            estimate = estimate_bytes(tp, method, rows)
            admitted, reservation, on_gpu = self._admit_both(tp.name, estimate)
            if not admitted:
                return False
            if not use(first, first + rows, reservation, on_gpu):
                return False
            first += rows
        return True

    def close(self) -> None:
        self.inflight.close()
        self.pool.shutdown(wait=True)


def _work_budget(governor: MemoryGovernor | None, gpu: MemoryGovernor | None) -> int | None:
    """What the budget leaves for units (None: no governor): it counts the whole process, whose own baseline is no
    room for work."""
    if governor is None:
        return None
    return min(governor.work_budget, gpu.budget) if gpu else governor.work_budget


@dataclass(frozen=True)
class Computing:
    """How the pipeline computes a plan's shards, wherever it runs (:func:`compute_shards`): stopped when
    ``should_stop`` turns true, at most ``workers`` units in flight; with a ``governor`` every unit is admitted
    against the memory budget, the number in flight follows its limit, and tensors of elementwise or streamed
    methods larger than a quarter of the budget are streamed in row chunks to the writer; streamed methods' tensors
    of several chunks are computed chunk by chunk in any case (:func:`~resumerge.merge.plan.workunits.unit_mode`
    decides). ``gpu`` governs the memory of the plan's GPU the same way (a unit holds its GPU reservation while it
    computes). ``transfers``: the run moves bytes over the network; when every method of the plan is elementwise (a few
    passes over memory, far faster than a link), the compute threads (the pool's and the writer's) yield the CPU to the
    transfers (:mod:`~resumerge.merge.engine.cpupriority`). Other methods can be what bounds the run (TIES on two
    cores):
    their threads keep their priority. Every unit's context holds the run's ``resources``."""

    should_stop: Callable[[], bool]
    resources: Resources
    workers: int = CONCURRENCY
    governor: MemoryGovernor | None = None
    gpu: MemoryGovernor | None = None
    transfers: bool = False


def compute_shards(plan: Plan, sources: InputSources, sink: OutputSink, journal: Journal, reporter: Reporter,
                   done: set[str], computing: Computing, *, batches: Iterable[Sequence[ShardPlan]] | None = None,
                   in_place: InPlace | None = None) -> bool:
    """Compute every shard of ``plan`` not in ``done`` as ``computing`` says and publish it through ``sink`` into
    ``journal`` (the pipeline of :func:`~resumerge.merge.engine.executors.execute`); False when stopped first. Raises
    the writer's error, else a KeyboardInterrupt that stopped it. ``batches``: the shards to compute instead, as they
    come (a cluster node's actor is fed them by the driver); each batch's last units are handed to the writer before
    the next batch is awaited, and the writer finishes one shard while the next one's units compute, as in a local
    run. ``in_place``: the files written in place, unit by unit, each with the units a previous run wrote
    (:func:`kept_units`): their tensors are not computed again; a file whose every unit is kept is only
    committed."""
    order = compute_order(plan) if batches is None else ()  # once: a 90k-tensor plan's order costs a moment
    # A streamed source coalesces the reads that come next.
    sources.expect(read_order(plan, done, order=order if batches is None else None))
    workers, governor, gpu = computing.workers, computing.governor, computing.gpu
    yield_cpu = computing.transfers and all(_elementwise(plan, t) for t in plan.tensors.values())
    if yield_cpu:
        start_hashing()  # at this thread's priority: the writer that would start it yields its own
    # The plan and everything made before the run (a 90k-tensor plan is a million objects) outlive it: kept out
    # of the collector's sight, they are not scanned again by every full collection the run's own garbage
    # triggers (a third of a 90k-tensor run's CPU). They are handed back to it when the shards are done.
    kept = dict(in_place.kept) if in_place is not None else {}
    # Files one computation writes together (a GGUF release's): computed once, by their lead, while any is pending.
    members = _members(plan, done)
    # Results written from the buffers they were computed in, which come back to the workspaces (bufferpool): the
    # idle ones kept are at most one worker's share of what the workspaces may keep.
    pool = BufferPool(workspace_bytes(_work_budget(governor, gpu), workers))
    # (a cluster node's batches are the driver's to choose: each shard written alone there, a release's files too)
    writer = Writer(plan, sink, journal, reporter, sources, yield_cpu, in_place=in_place, pool=pool,
                    members=members if batches is None else None)
    writer.start()
    skipped = _skipped(plan, members, kept)
    if batches is None:
        order = tuple(s for s in order if members.get(s.name))
        for shard in order:  # every unit kept: the writer commits them before any other shard
            if shard.tensors and all(n in skipped for n in shard.tensors):
                writer.items.put((shard, (), [], None))
    pipeline = _Pipeline(plan, sources, writer, governor, workers, computing.should_stop, computing.resources, gpu,
                         yield_cpu)
    finished = False
    interrupt: KeyboardInterrupt | None = None  # Ctrl-C where Python's own handler stands (library use)
    with alive_frozen():  # (what existed before the run is never walked by the collections its garbage makes)
        try:
            if batches is None:
                finished = pipeline.run(_tensors_of(plan, order, skipped))
            else:
                finished = all(pipeline.run(_tensors_of(plan, batch, skipped)) for batch in batches)
        except KeyboardInterrupt as exc:
            interrupt = exc
        finally:
            if not finished:
                writer.leaving.set()
                sources.stop()  # workers waiting for input bytes still downloading give up
            pipeline.close()
            if not finished:
                writer.drain()
            writer.items.put(None)
            writer.join()
            if not finished:
                writer.abort()
    if writer.error is not None:
        raise writer.error
    if interrupt is not None:
        raise interrupt
    return finished

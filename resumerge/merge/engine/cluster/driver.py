"""The Ray executor: the driver feeds the pending output shards to a long-lived worker per node, then publishes
and journals each one.

The driver has a :class:`~resumerge.merge.engine.cluster.worker.ShardStream` actor on every node (one per share of its
CPUs as wide as the run's thread count: started warm while the run planned, else once the plan is known; see
:mod:`~resumerge.machine.cluster.launch`) and keeps :data:`~resumerge.machine.cluster.launch.AHEAD` shards fed
to each, so that a node computes one shard while it writes the one before, as a local run does. Only the driver (the
process that runs ``resumerge run`` or ``resume``) writes the ledger and the manifest and commits: a worker returns
each shard's temp path and digests (:class:`~resumerge.merge.engine.cluster.worker.ShardDone`), and the driver publishes
that file through the run's sink (a rename in the shared OUT, a staged copy, or an upload and commit of a hub repo)
and journals it with the run's :class:`~resumerge.merge.store.journal_commit.CommitJournal`, as the local executor's
writer does. The frozen plan goes through Ray's object store once; tensors never do.

Faults: the shards of a worker whose process or node died go back to the front of the queue, to the workers left
(:data:`REISSUES` times each), to a fresh temp path; the shard's bytes do not depend on where it ran. A shard that
failed gets its own error re-raised here, so the run ends with the same one-line error and exit code as the local
executor. A stopped run (SIGINT, SIGTERM) stops its workers, which abandon their shards, then ends their actors.
A driver killed at any instant takes its actors with it (Ray ends a dead driver's job), and its kept workers stop
its shards on their own (:mod:`~resumerge.machine.cluster.keeper`); the resume, with either executor, keeps every
shard the ledger records and makes the rest again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from resumerge.config.settings import RunSettings
from resumerge.errors import UnreachableError
from resumerge.machine.cluster.launch import AHEAD, Worker, adopt, default_threads, end, fit, place, unreserve
from resumerge.machine.durable import discard, is_temp_name, storage_error
from resumerge.machine.memory.sizes import format_size
from resumerge.machine.rayconnect import join
from resumerge.machine.torch_import import IMPORT_RESERVE, torch
from resumerge.merge.engine.cluster import STREAM
from resumerge.merge.engine.cluster.hubreads import NodeReads
from resumerge.merge.engine.cluster.upload import HubPlace, commit_operation, task_cpus
from resumerge.merge.engine.cluster.warm import WarmStart
from resumerge.merge.engine.cluster.worker import ShardDone, WorkerSetup
from resumerge.merge.engine.devices import is_gpu
from resumerge.merge.engine.executor import CONCURRENCY
from resumerge.merge.engine.job import Job
from resumerge.merge.engine.runend import finish_run
from resumerge.merge.plan.fetching import read_order, shard_input_files
from resumerge.merge.plan.merge_plan import Plan, ShardPlan
from resumerge.merge.plan.planner import threads_matter
from resumerge.merge.plan.workorder import compute_order
from resumerge.merge.plan.workunits import estimate_bytes
from resumerge.merge.store.hubsink import HubRepoSink
from resumerge.merge.store.journal_commit import CommitJournal
from resumerge.merge.store.nodestats import NODE_EVENT, node_line

# The driver's re-issues of a shard whose worker was lost (its process or node died) before the run gives up.
REISSUES = 3
# How long the driver waits for a result before it looks at the stop flag and the commits again.
POLL_SECONDS = 0.25
# How long a stopped run waits for its workers to abandon their shards (deleting their temp files) before it kills
# them.
STOP_SECONDS = 10.0


class RayDriver:
    """The executor of ``--executor ray``: the pending output shards fed to a worker per node, the ledger kept by
    this process."""

    def __init__(self, ray: ModuleType, warm: WarmStart | None = None) -> None:
        self.ray, self.warm = ray, warm

    @classmethod
    def connect(cls, address: str | None, warm: WarmStart | None = None) -> RayDriver:
        """Join the cluster at ``address`` (see :func:`~resumerge.machine.rayconnect.join`), once the ``warm``
        start of the run's workers, if any, has joined it (its workers are taken when the run starts)."""
        if warm is not None:
            warm.joined()
        return cls(join(address), warm)

    def run(self, job: Job) -> tuple[str, ...]:
        """Every pending shard of ``job`` computed by the nodes' workers and journaled here, then the run's side
        files and last commits (:func:`~resumerge.merge.engine.runend.finish_run`)."""
        done = {row.name for row in job.ledger.files() if row.status == "done"}
        journal = CommitJournal(job.sink, job.ledger, job.book)
        interrupt: KeyboardInterrupt | None = None
        try:
            warm, self.warm = self.warm, None  # a recipe's later stages start their own
            finished = _Dispatch(self.ray, job, journal, done, warm).run()
        except KeyboardInterrupt as exc:
            interrupt, finished = exc, False
        return finish_run(job.plan, journal, job.reporter, done, finished=finished, interrupt=interrupt,
                          config_text=job.config_text, should_stop=job.should_stop, late_notes=job.late_notes)


class _Dispatch:
    """One run's workers: a long-lived actor per node (per share of its CPUs) fed a few shards ahead, their results
    published in any order."""

    def __init__(self, ray: ModuleType, job: Job, journal: CommitJournal, done: set[str],
                 warm: WarmStart | None) -> None:
        self.ray, self.job, self.journal, self.warm = ray, job, journal, warm
        self.start = warm  # which holds the run's kept workers until the API call ends
        self.plan = job.plan
        # Shards to feed, in compute order, with the times each was re-issued: a lost worker's shards go back to the
        # front. Fed largest first where their inputs allow (next_shard).
        self.pending: deque[tuple[ShardPlan, int]] = deque(
            (shard, 0) for shard in compute_order(self.plan) if shard.name not in done)
        self.files = {shard.name: shard_input_files(self.plan, shard) for shard, _ in self.pending}
        self.inflight: dict[Any, tuple[ShardPlan, int, Worker]] = {}  # object ref -> shard, re-issues, worker
        self.beginning: dict[Any, Worker] = {}  # warm workers' begin calls not answered yet
        self.workers: list[Worker] = []
        self.lost: set[str] = set()  # nodes whose worker died: none is started there again
        self.folders: set[Path] = set()  # where the workers write their temp files
        self.published: set[Path] = set()  # the temp files handed to the sink
        self.nodes: dict[str, tuple[int, int, float]] = {}  # node -> shards, bytes, writer seconds
        # The run's thread count: every node computes with it where the bytes of the plan's methods depend on it,
        # else with the CPUs its worker declares (cores.node_cores).
        settings = job.settings
        # A hub OUT: each node uploads what it made (the driver commits), staging under --max-disk per node.
        self.hub = job.sink if isinstance(job.sink, HubRepoSink) else None
        upload = None if self.hub is None else HubPlace.of(self.hub.repo, self.hub.resume)
        self.setup = WorkerSetup(_threads(self.plan, settings), settings.max_memory, settings.max_gpu_memory, upload,
                                 NodeReads.of(job), checksum=journal.checksum)
        self.memory = max((self._memory(shard) for shard, _ in self.pending), default=IMPORT_RESERVE)
        self.shared = ray.put((self.plan, job.resources))

    def run(self) -> bool:
        """Feed, collect and journal until every shard is done (True) or the run is stopped (False); raises a
        shard's own error, or :class:`UnreachableError` when the cluster keeps losing a shard's workers."""
        self.job.sources.expect(read_order(self.plan, {s.name for s in self.plan.shards} - {
            s.name for s, _ in self.pending}))
        try:
            if self.pending:
                self._start_workers()
                if not self.workers:  # stopped while the warm start was under way
                    return False
            while self.pending or self.inflight:
                while self.pending and (worker := self._hungriest()) is not None:
                    if not self._feed(worker, *next_shard(self.pending, self._landed)):
                        return False
                ready, stop = answered(self.ray, [*self.inflight, *self.beginning], self.job.should_stop)
                for ref in ready:
                    if ref in self.beginning:
                        self._begun(ref)
                    else:
                        self._collect(ref)
                self.journal.settle()  # hub commits that landed meanwhile
                if stop:
                    return False
            return True
        finally:
            self._close()
            self._sweep()

    def _start_workers(self) -> None:
        """The workers of every live node with a CPU (a GPU with ``--device cuda``) not lost yet, one per share of
        the node's CPUs as wide as the run's thread count, each declaring those CPUs and the memory the plan's
        largest shard needs (at most what its node has): the warm ones taken from the run's start when they fit
        (:func:`~resumerge.machine.cluster.launch.fit`, :func:`~resumerge.machine.cluster.launch.adopt`), else
        ones started now. Raises :class:`UnreachableError`
        when no node is left; none, with nothing placed, when the run is stopped while the warm start is under
        way."""
        gpu = is_gpu(self.plan.options.device)
        nodes = self.ray.nodes()
        wanted = self._width(nodes)
        start, self.warm = self.warm, None
        warm: list[Worker] = []
        if start is not None:
            warm = start.take(self.job.should_stop, POLL_SECONDS)  # ours to end (or release) from here
            if start.other:  # said once a stage: a digest that differs between driver and workers ends every reuse
                self.job.reporter.message(f"Ray workers: {start.other} kept ones refused this run: they run other "
                                          "code or another runtime_env than this driver")
            if self.job.should_stop():
                end(self.ray, warm)
                return
        if warm:
            try:
                warm, spare = fit(warm, nodes, wanted)
                end(self.ray, spare)  # kept ones that the run's width leaves over: released for the next run
                adopted = not gpu and adopt(self.ray, warm, nodes, self.shared, self.setup, wanted, self.memory)
            except BaseException:
                end(self.ray, warm)
                raise
            if adopted:  # (else killed: released, they would declare their memory beside the fresh workers)
                self.workers = warm
                self.beginning = {worker.begun: worker for worker in warm}
                reused = start.reused if start is not None else 0
                self.job.reporter.message(f"Ray workers: {reused} kept from a run before, {len(warm) - reused} "
                                          "started for this one")
                return
            end(self.ray, warm, kill=True)
        self.workers = place(self.ray, nodes, self.shared, self.setup, wanted, self.memory, gpu=gpu, lost=self.lost,
                             stream=STREAM)
        self.job.reporter.message(f"Ray workers: {len(self.workers)} started for this run")

    def _width(self, nodes: list[dict[str, Any]]) -> int:
        """The CPUs each worker declares: the run's thread count, raised for a hub OUT under ``--max-disk`` so that no
        node runs more workers than it may stage shards (each stages one at a time until uploaded)."""
        if self.hub is None:
            return self.setup.threads
        cpus = [n.get("Resources", {}).get("CPU", 0) for n in nodes if n.get("Alive")]
        budget = self.hub.budget
        return task_cpus(self.setup.threads, cpus, budget.max_disk if budget is not None else None,
                         max((s.file_size for s in self.plan.shards), default=0))

    def _hungriest(self) -> Worker | None:
        """The worker with the fewest shards fed, if it has room for another."""
        worker = min(self.workers, key=lambda w: w.fed, default=None)
        return worker if worker is not None and worker.fed < AHEAD else None

    def _feed(self, worker: Worker, shard: ShardPlan, reissued: int) -> bool:
        """Feed ``shard`` to ``worker`` once its inputs are checked (a hub download lands on the driver's cache
        first); False when the run is stopped while waiting."""
        for model, file in self.files[shard.name]:
            while not self.job.sources.checked(model, file, POLL_SECONDS):
                if self.job.should_stop():
                    return False
        sink = self.job.sink
        # Staged on the node that makes it when it uploads itself: the same path on that node's disk.
        folder = sink.where(shard.name).parent if self.setup.upload is not None else sink.temp_for(shard.name).parent
        self.folders.add(folder)
        self.inflight[worker.actor.compute.remote(shard.name, str(folder))] = (shard, reissued, worker)
        worker.fed += 1
        return True

    def _landed(self, shard: ShardPlan) -> bool:
        """Whether every input file ``shard`` reads is checked now (a hub download's once it landed; local and
        streamed inputs at once)."""
        return all(self.job.sources.checked(model, file, 0) for model, file in self.files[shard.name])

    def _memory(self, shard: ShardPlan) -> int:
        """What a worker computing ``shard`` needs: torch, plus the largest units the pipeline holds at once,
        twice (in flight and queued to the writer)."""
        units = sorted((estimate_bytes(tp, self.plan.method_of(tp))
                        for tp in (self.plan.tensors[name] for name in shard.tensors)), reverse=True)
        return IMPORT_RESERVE + 2 * sum(units[:CONCURRENCY])

    def _begun(self, ref: Any) -> None:
        """A warm worker's begin call answered: raises its error (the run stops, as on a shard's), or loses the
        worker whose process or node died."""
        worker = self.beginning.pop(ref)
        exceptions = self.ray.exceptions
        try:
            self.ray.get(ref)
        except exceptions.RayTaskError as exc:
            _raise_cause(exc)
        except exceptions.RayError:  # its shards fed meanwhile fail too, and come back to the queue
            self._lose(worker)

    def _collect(self, ref: Any) -> None:
        shard, reissued, worker = self.inflight.pop(ref)
        worker.fed -= 1
        exceptions = self.ray.exceptions
        try:
            result: ShardDone = self.ray.get(ref)
        except exceptions.RayTaskError as exc:  # the shard failed (its temp file deleted): the run stops
            _raise_cause(exc)
        except exceptions.RayError as exc:  # its worker's process or node was lost
            self._lose(worker)
            if reissued >= REISSUES:
                raise UnreachableError(f"the Ray cluster lost every worker that computed {shard.name}: {exc}",
                                       hint="check the cluster's nodes, then run resumerge resume OUT") from None
            self.job.reporter.message(f"{shard.name}: its worker on node {worker.node} was lost; computing it again")
            self.pending.appendleft((shard, reissued + 1))
            return
        self._publish(shard, replace(result, node=worker.node))

    def _lose(self, worker: Worker) -> None:
        """Forget a worker that died (its other shards fail too and come back here), killed even when kept (a
        release would stop its stream, failing its other shards instead of re-issuing them); start workers on the
        nodes left when none is."""
        if worker not in self.workers:
            return
        self.workers.remove(worker)
        self.lost.add(worker.node)
        end(self.ray, [worker], kill=True)
        if not self.workers:
            self._start_workers()

    def _publish(self, shard: ShardPlan, result: ShardDone) -> None:
        """Publish the shard a worker wrote through the run's sink (or, uploaded by its node, commit the node's
        upload) and journal it, as the local writer does."""
        job = self.job
        if job.hub is not None and (result.reads or result.fetched):  # what the node streamed: checked here first
            job.hub.read_elsewhere(result.reads, result.fetched)
        job.reporter.shard_started(shard.name, shard.file_size, len(shard.tensors))
        if job.sink.commits_later:
            job.sink.commit_when(shard.name, self._checked_now(shard))
        if result.uploaded is not None and self.hub is not None:  # nothing staged here: the hub holds the object
            op = commit_operation(shard.name, result.size, result.sha256, result.uploaded)
            receipt = self.hub.publish_uploaded(shard.name, op, result.sha256, result.size)
        else:
            temp = Path(result.temp)
            self.published.add(temp)  # a sink that commits later keeps it until its commit
            try:
                receipt = job.sink.publish(temp, shard.name, result.sha256)
            except OSError as exc:
                discard(temp)
                raise storage_error(exc, job.sink.where(shard.name)) from exc
        self.journal.record(receipt, result.size, result.sha256, seconds=result.seconds, tensors=result.tensors)
        for name in result.tensors:
            job.reporter.tensor_done(name, self.plan.tensors[name].nbytes)
        job.reporter.file_done(shard.name, "shard")
        cores = {} if result.cores is None else {"threads": result.cores.threads, "units": result.cores.units}
        job.ledger.event(NODE_EVENT, f"{shard.name} made on node {result.node}",
                         {"node": result.node, "shard": shard.name, "bytes": result.size,
                          "seconds": round(result.seconds, 3), "pid": result.pid, **cores})
        shards, nbytes, seconds = self.nodes.get(result.node, (0, 0, 0.0))
        self.nodes[result.node] = tally = (shards + 1, nbytes + result.size, seconds + result.seconds)
        job.reporter.message(node_line((result.node, *tally), format_size))

    def _checked_now(self, shard: ShardPlan) -> Callable[[], bool]:
        files, sources = self.files[shard.name], self.job.sources
        return lambda: all(sources.checked(model, file, 0) for model, file in files)

    def _sweep(self) -> None:
        """Delete what lost or stopped shards left in the temp folders once the workers are gone: the partial temp
        files of workers whose node died mid-write (a resume would delete them too, later)."""
        names = {shard.name for shard in self.plan.shards}
        for folder in self.folders:
            if not folder.is_dir():  # a node's staging folder that this machine does not have
                continue
            for leftover in folder.iterdir():
                if is_temp_name(leftover.name, names) and leftover not in self.published:
                    discard(leftover)

    def _close(self) -> None:
        """Stop every worker (a stopped or failed run's abandon their shards and delete their temp files), then end
        their actors, or hand the kept ones that stopped to the run's warm start, which releases them when the API
        call ends (a recipe's later stage leases them again:
        :meth:`~resumerge.merge.engine.cluster.warm.WarmStart.take`); their reservations removed: no work of this run
        goes on after it."""
        # The shards' calls, answered once their worker stopped (Stopped, mostly), are read: Ray prints an error
        # nobody read.
        stopped: set[Worker] = set()
        try:  # (a second Ctrl-C while the workers stop: they are killed below, none held)
            stops = {worker.actor.stop.remote(): worker for worker in self.workers}
            waits = [*stops, *self.inflight, *self.beginning]
            answered, _ = self.ray.wait(waits, num_returns=len(waits), timeout=STOP_SECONDS) if waits else ([], [])
            for ref in answered:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayError:
                    continue
            stopped = {stops[ref] for ref in answered if ref in stops}
        finally:
            held = [w for w in self.workers if w.token is not None and w in stopped] if self.start is not None else []
            end(self.ray, [w for w in self.workers if w not in held], kill=True)  # a kept one that did not stop too
            if held and self.start is not None:
                unreserve(held)
                self.start.hold(held)
        self.workers.clear()
        self.inflight.clear()
        self.beginning.clear()


def next_shard(pending: deque[tuple[ShardPlan, int]],
               landed: Callable[[ShardPlan], bool]) -> tuple[ShardPlan, int]:
    """Take the next shard to feed from ``pending`` (in compute order, a lost worker's re-issued ones at the front):
    a re-issued one first; else the largest whose inputs have ``landed`` (the first in compute order among equal
    sizes); else the first, whose inputs land first (the driver feeds it once they have, as a local run would
    compute it). Largest first because the nodes finish together only if the run's last shards are its smallest: in
    compute order a Llama's embeddings, twice a layer's shard, came last, and one node merged them alone for a
    quarter of a two-node run (bench/RESULTS.md, session 26). A shard's file size stands for its work, which its
    bytes in and its compute both follow."""
    if pending[0][1]:
        return pending.popleft()
    best = None
    for index, (shard, _) in enumerate(pending):
        if (best is None or shard.file_size > pending[best][0].file_size) and landed(shard):
            best = index
    item = pending[best or 0]
    del pending[best or 0]
    return item


def answered(ray: ModuleType, refs: list[Any], should_stop: Callable[[], bool]) -> tuple[list[Any], bool]:
    """The calls of ``refs`` answered within :data:`POLL_SECONDS` (the first one, or more that came at once), and
    whether the run is stopped: then every one already answered, so that a stopped run keeps every result already
    made before it honours the stop."""
    ready, rest = ray.wait(refs, num_returns=1, timeout=POLL_SECONDS)
    stop = should_stop()
    if stop and rest:
        ready = [*ready, *ray.wait(rest, num_returns=len(rest), timeout=0)[0]]
    return ready, stop


def _raise_cause(exc: Any) -> None:
    """Raise the error a worker's call raised (a ``RayTaskError``'s cause), as the local executor would."""
    cause = exc.cause
    raise (cause if isinstance(cause, Exception) else exc) from None


def _threads(plan: Plan, settings: RunSettings) -> int:
    """Every node's thread count: ``-j``, else this process's torch's own where a method's bytes depend on it (as a
    local run computes), else :func:`~resumerge.machine.cluster.launch.default_threads` (without importing torch:
    the driver computes nothing, and its import is two CPU seconds beside the workers' own)."""
    if settings.num_threads is None and threads_matter({tp.method for tp in plan.tensors.values()}, plan.units):
        return int(torch.get_num_threads())
    return default_threads(settings.num_threads)

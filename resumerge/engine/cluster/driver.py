"""The Ray executor: the driver feeds the pending output shards to a long-lived worker per node, then publishes
and journals each one.

The driver has a :class:`~resumerge.engine.cluster.worker.ShardStream` actor on every node (one per share of its
CPUs as wide as the run's thread count: started warm while the run planned, or as soon as the plan is known, see
:mod:`~resumerge.engine.cluster.launch`) and keeps :data:`~resumerge.engine.cluster.launch.AHEAD` shards fed to
each, so that a node computes one shard while it writes the one before, as a local run does. Only the driver
(the process that runs ``resumerge run`` or ``resume``) writes the ledger and the manifest and commits: a worker
returns each shard's temp path and digests (:class:`~resumerge.engine.cluster.worker.ShardDone`), and the driver
publishes that file through the run's sink (a rename in the shared OUT, a staged copy, or an upload and commit of a
hub repo) and journals it with the run's :class:`~resumerge.store.journal_commit.CommitJournal`, as the local
executor's writer does. The frozen plan goes
through Ray's object store once; tensors never do.

Faults: the shards of a worker whose process or node died go back to the front of the queue, to the workers left
(:data:`REISSUES` times each), to a fresh temp path; the shard's bytes do not depend on where it ran. A shard that
failed gets its own error re-raised here, so the run ends with the same one-line error and exit code as the local
executor. A stopped run (SIGINT, SIGTERM) stops its workers, which abandon their shards, then ends their actors.
A driver killed at any instant takes its actors with it (Ray ends a dead driver's job); the resume, with either
executor, keeps every shard the ledger records and makes the rest again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from resumerge.config.settings import RunSettings
from resumerge.engine.cluster.connect import join
from resumerge.engine.cluster.early import claim
from resumerge.engine.cluster.hubreads import NodeReads
from resumerge.engine.cluster.launch import AHEAD, Launch, Worker, end
from resumerge.engine.cluster.upload import HubPlace, commit_operation
from resumerge.engine.cluster.worker import ShardDone
from resumerge.engine.executor import finish_run
from resumerge.engine.job import Job
from resumerge.errors import UnreachableError
from resumerge.memory.sizes import format_size
from resumerge.methods.resources import Resources
from resumerge.plan.fetching import read_order, shard_input_files
from resumerge.plan.merge_plan import Plan, ShardPlan
from resumerge.plan.workorder import compute_order
from resumerge.store.durable import discard, is_temp_name, storage_error
from resumerge.store.hubsink import HubRepoSink
from resumerge.store.journal_commit import CommitJournal
from resumerge.store.nodestats import NODE_EVENT, node_line

# The driver's re-issues of a shard whose worker was lost (its process or node died) before the run gives up.
REISSUES = 3
# How long the driver waits for a result before it looks at the stop flag and the commits again.
POLL_SECONDS = 0.25
# How long a stopped run waits for its workers to abandon their shards (deleting their temp files) before it kills
# them.
STOP_SECONDS = 10.0


class RayExecutor:
    """The executor of ``--executor ray``: the pending output shards fed to a worker per node, the ledger kept by
    this process."""

    def __init__(self, ray: ModuleType, warm: list[Worker] | None = None) -> None:
        self.ray = ray
        self.warm = warm or []  # workers started before the plan existed, waiting for it
        self.early: tuple[Launch, list[Worker]] | None = None  # workers started before the run, not yet fed

    @classmethod
    def connect(cls, address: str | None) -> RayExecutor:
        """Join the cluster at ``address`` (see :func:`~resumerge.engine.cluster.connect.join`), taking the warm
        workers its early join started (:func:`~resumerge.engine.cluster.launch.warm_workers`)."""
        warm = claim()  # waits for the early join, if any: the join below is then made
        return cls(join(address), warm)

    def start_early(self, plan: Plan, resources: Resources, settings: RunSettings) -> None:
        """Start the workers of ``plan`` now, for a run whose OUT is a folder (a hub OUT's are started by
        :meth:`run`: they need the sink's repo): the warm ones given the plan, else fresh ones, whose start (a
        process importing torch and the engine) then overlaps the driver's own work (opening OUT, the ledger,
        reconciling) instead of following it. Raises :class:`UnreachableError` when the cluster has no node to
        compute on."""
        launch = Launch.of(self.ray, plan, resources, settings, plan.shards)
        warm, self.warm = self.warm, []
        if not launch.adopt(self.ray, warm):
            end(self.ray, warm)
            warm = launch.start(self.ray, set())
        self.early = (launch, warm)

    def close(self) -> None:
        """End the workers started early that no run took (the run was refused after they started)."""
        end(self.ray, self.warm)
        self.warm = []
        if self.early is not None:
            end(self.ray, self.early[1])
            self.early = None

    def run(self, job: Job) -> tuple[str, ...]:
        """Every pending shard of ``job`` computed by the nodes' workers and journaled here, then the run's side
        files and last commits (:func:`~resumerge.engine.executor.finish_run`)."""
        done = {row.name for row in job.ledger.files() if row.status == "done"}
        journal = CommitJournal(job.sink, job.ledger, job.book)
        interrupt: KeyboardInterrupt | None = None
        early, self.early = self.early, None
        reads = NodeReads.of(job)  # streamed hub inputs: what the early workers' setup lacks
        if early is not None and (early[0].plan is not job.plan or isinstance(job.sink, HubRepoSink) or reads):
            end(self.ray, early[1])
            early = None
        warm, self.warm = self.warm, []
        try:
            finished = _Dispatch(self.ray, job, journal, done, reads, early, warm).run()
        except KeyboardInterrupt as exc:
            interrupt, finished = exc, False
        return finish_run(job.plan, journal, job.reporter, done, finished=finished, interrupt=interrupt,
                          config_text=job.config_text, should_stop=job.should_stop, late_notes=job.late_notes)


class _Dispatch:
    """One run's workers: a long-lived actor per node (per share of its CPUs) fed a few shards ahead, their results
    published in any order."""

    def __init__(self, ray: ModuleType, job: Job, journal: CommitJournal, done: set[str], reads: NodeReads | None,
                 early: tuple[Launch, list[Worker]] | None = None, warm: list[Worker] | None = None) -> None:
        self.ray, self.job, self.journal = ray, job, journal
        self.plan = job.plan
        # Shards to feed, with the times each was re-issued: a lost worker's shards go back to the front.
        self.pending: deque[tuple[ShardPlan, int]] = deque(
            (shard, 0) for shard in compute_order(self.plan) if shard.name not in done)
        self.inflight: dict[Any, tuple[ShardPlan, int, Worker]] = {}  # object ref -> shard, re-issues, worker
        self.workers: list[Worker] = [] if early is None else early[1]
        self.lost: set[str] = set()  # nodes whose worker died: none is started there again
        self.folders: set[Path] = set()  # where the workers write their temp files
        self.published: set[Path] = set()  # the temp files handed to the sink
        self.nodes: dict[str, tuple[int, int, float]] = {}  # node -> shards, bytes, writer seconds
        # A hub OUT: each node uploads what it made (the driver commits), staging under --max-disk per node.
        self.hub = job.sink if isinstance(job.sink, HubRepoSink) else None
        if early is not None:
            self.launch = early[0]
        else:
            place = None if self.hub is None else HubPlace.of(self.hub.repo, self.hub.resume)
            self.launch = Launch.of(ray, self.plan, job.resources, job.settings, (s for s, _ in self.pending), place,
                                    None if self.hub is None else self.hub.max_disk, reads)
            if warm and self.launch.adopt(ray, warm):  # started before the plan: a hub OUT's, given it now
                self.workers = warm
            else:
                end(ray, warm or [])
        self.setup = self.launch.setup

    def run(self) -> bool:
        """Feed, collect and journal until every shard is done (True) or the run is stopped (False); raises a
        shard's own error, or :class:`UnreachableError` when the cluster keeps losing a shard's workers."""
        self.job.sources.expect(read_order(self.plan, {s.name for s in self.plan.shards} - {
            s.name for s, _ in self.pending}))
        try:
            if self.pending and not self.workers:
                self.workers = self.launch.start(self.ray, self.lost)
            while self.pending or self.inflight:
                while self.pending and (worker := self._hungriest()) is not None:
                    if not self._feed(worker, *self.pending.popleft()):
                        return False
                ready, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=POLL_SECONDS)
                if self.job.should_stop():
                    return False
                for ref in ready:
                    self._collect(ref)
                self.journal.settle()  # hub commits that landed meanwhile
            return True
        finally:
            self._close()
            self._sweep()

    def _hungriest(self) -> Worker | None:
        """The worker with the fewest shards fed, if it has room for another."""
        worker = min(self.workers, key=lambda w: w.fed, default=None)
        return worker if worker is not None and worker.fed < AHEAD else None

    def _feed(self, worker: Worker, shard: ShardPlan, reissued: int) -> bool:
        """Feed ``shard`` to ``worker`` once its inputs are checked (a hub download lands on the driver's cache
        first); False when the run is stopped while waiting."""
        for model, file in shard_input_files(self.plan, shard):
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

    def _collect(self, ref: Any) -> None:
        shard, reissued, worker = self.inflight.pop(ref)
        worker.fed -= 1
        exceptions = self.ray.exceptions
        try:
            result: ShardDone = self.ray.get(ref)
        except exceptions.RayTaskError as exc:  # the shard failed (its temp file deleted): the run stops
            cause = exc.cause
            raise (cause if isinstance(cause, Exception) else exc) from None
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
        """Forget a worker that died (its other shards fail too and come back here); start workers on the nodes
        left when none is."""
        if worker not in self.workers:
            return
        self.workers.remove(worker)
        self.lost.add(worker.node)
        end(self.ray, [worker])
        if not self.workers:
            self.workers = self.launch.start(self.ray, self.lost)

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
        job.ledger.event(NODE_EVENT, f"{shard.name} made on node {result.node}",
                         {"node": result.node, "shard": shard.name, "bytes": result.size,
                          "seconds": round(result.seconds, 3)})
        shards, nbytes, seconds = self.nodes.get(result.node, (0, 0, 0.0))
        self.nodes[result.node] = tally = (shards + 1, nbytes + result.size, seconds + result.seconds)
        job.reporter.message(node_line((result.node, *tally), format_size))

    def _checked_now(self, shard: ShardPlan) -> Callable[[], bool]:
        files, sources = shard_input_files(self.plan, shard), self.job.sources
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
        their actors: no work of this run goes on after it."""
        # The shards' calls, answered once their worker stopped (Stopped, mostly), are read: Ray prints an error
        # nobody read.
        waits = [worker.actor.stop.remote() for worker in self.workers] + list(self.inflight)
        answered, _ = self.ray.wait(waits, num_returns=len(waits), timeout=STOP_SECONDS) if waits else ([], [])
        for ref in answered:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError:
                continue
        end(self.ray, self.workers)
        self.workers.clear()
        self.inflight.clear()


"""The Ray executor: the driver hands each pending output shard to a Ray task, then publishes and journals it.

Only the driver (the process that runs ``resumerge run`` or ``resume``) writes the ledger and the manifest and
commits: a task returns its shard's temp path and digests (:class:`~resumerge.engine.cluster.worker.ShardDone`),
and the driver publishes that file through the run's sink (a rename in the shared OUT, a staged copy, or an upload
and commit of a hub repo) and journals it with the run's :class:`~resumerge.store.journal_commit.CommitJournal`,
as the local executor's writer does. The frozen plan goes through Ray's object store once; tensors never do.

Faults: a task whose worker process or node died is retried by Ray (``max_retries``), then re-issued here
(:data:`REISSUES`) to a fresh temp path; the shard's bytes do not depend on where it ran. A task that raised gets
its own error re-raised here, so the run ends with the same one-line error and exit code as the local executor.
A driver killed at any instant takes its tasks with it (Ray ends a dead driver's job); the resume, with either
executor, keeps every shard the ledger records and makes the rest again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from resumerge.engine.cluster.connect import join
from resumerge.engine.cluster.worker import ShardDone, ShardTask, compute_shard
from resumerge.engine.devices import is_gpu
from resumerge.engine.executor import CONCURRENCY, finish_run
from resumerge.engine.job import Job
from resumerge.errors import UnreachableError
from resumerge.memory.sizes import format_size
from resumerge.methods.resources import Resources
from resumerge.plan.fetching import read_order, shard_input_files
from resumerge.plan.merge_plan import Plan, ShardPlan
from resumerge.plan.workorder import compute_order
from resumerge.plan.workunits import estimate_bytes
from resumerge.store.durable import discard, is_temp_name, storage_error
from resumerge.store.journal_commit import CommitJournal
from resumerge.store.nodestats import NODE_EVENT, node_line
from resumerge.torch_import import IMPORT_RESERVE, torch

# Ray's own retries of a task whose worker process or node died, then the driver's re-issues of it.
RAY_RETRIES = 2
REISSUES = 2
# How long the driver waits for a result before it looks at the stop flag and the commits again.
POLL_SECONDS = 0.25


def run_task(task: ShardTask, shared: tuple[Plan, Resources]) -> ShardDone:
    """The Ray task: :func:`compute_shard` on this node, its result labelled with the node that made it."""
    from dataclasses import replace

    import ray

    plan, resources = shared
    done = compute_shard(task, plan, resources)
    return replace(done, node=ray.get_runtime_context().get_node_id()[:8])


class RayExecutor:
    """The executor of ``--executor ray``: a Ray task per pending output shard, the ledger kept by this process."""

    def __init__(self, ray: ModuleType) -> None:
        self.ray = ray

    @classmethod
    def connect(cls, address: str | None) -> RayExecutor:
        """Join the cluster at ``address`` (see :func:`~resumerge.engine.cluster.connect.join`)."""
        return cls(join(address))

    def run(self, job: Job) -> tuple[str, ...]:
        """Every pending shard of ``job`` computed by a task and journaled here, then the run's side files and
        last commits (:func:`~resumerge.engine.executor.finish_run`)."""
        done = {row.name for row in job.ledger.files() if row.status == "done"}
        journal = CommitJournal(job.sink, job.ledger, job.book)
        interrupt: KeyboardInterrupt | None = None
        try:
            finished = _Dispatch(self.ray, job, journal, done).run()
        except KeyboardInterrupt as exc:
            interrupt, finished = exc, False
        return finish_run(job.plan, journal, job.reporter, done, finished=finished, interrupt=interrupt,
                          config_text=job.config_text, should_stop=job.should_stop, late_notes=job.late_notes)


class _Dispatch:
    """One run's tasks: submitted a few per CPU of the cluster ahead, their results published in any order."""

    def __init__(self, ray: ModuleType, job: Job, journal: CommitJournal, done: set[str]) -> None:
        self.ray, self.job, self.journal = ray, job, journal
        self.plan = job.plan
        self.pending = [shard for shard in compute_order(self.plan) if shard.name not in done]
        self.inflight: dict[Any, tuple[ShardPlan, int]] = {}  # object ref -> shard, times re-issued
        self.folders: set[Path] = set()  # where the tasks write their temp files
        self.published: set[Path] = set()  # the temp files handed to the sink
        self.nodes: dict[str, tuple[int, int, float]] = {}  # node -> shards, bytes, task seconds
        # Every node computes with the driver's thread count: the bytes of some methods depend on it.
        threads = job.settings.num_threads or torch.get_num_threads()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        self.cpus = max(1, min(threads, int(max((n.get("CPU", 1) for n in nodes), default=1))))
        self.largest_memory = int(max((n.get("memory", 0) for n in nodes), default=0))
        self.ahead = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        self.threads = threads
        # max_calls=0: a worker computes shard after shard (GPU tasks would otherwise get a fresh process, and a
        # fresh CUDA context and torch import, per shard).
        self.remote = ray.remote(max_calls=0)(run_task)
        self.shared = ray.put((self.plan, job.resources))

    def run(self) -> bool:
        """Submit, collect and journal until every shard is done (True) or the run is stopped (False); raises a
        task's own error, or :class:`UnreachableError` when the cluster keeps losing a shard's workers."""
        self.job.sources.expect(read_order(self.plan, {s.name for s in self.plan.shards} - {
            s.name for s in self.pending}))
        try:
            while self.pending or self.inflight:
                while self.pending and len(self.inflight) < self.ahead:
                    if not self._submit(self.pending.pop(0), 0):
                        return False
                ready, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=POLL_SECONDS)
                if self.job.should_stop():
                    return False
                for ref in ready:
                    self._collect(ref)
                self.journal.settle()  # hub commits that landed meanwhile
            self._sweep()
            return True
        finally:
            self._cancel()

    def _submit(self, shard: ShardPlan, reissued: int) -> bool:
        """Start the task of ``shard`` once its inputs are checked (a hub download lands on the driver's cache
        first); False when the run is stopped while waiting."""
        for model, file in shard_input_files(self.plan, shard):
            while not self.job.sources.checked(model, file, POLL_SECONDS):
                if self.job.should_stop():
                    return False
        settings, folder = self.job.settings, self.job.sink.temp_for(shard.name).parent
        self.folders.add(folder)
        task = ShardTask(shard.name, str(folder), self.threads, settings.max_memory, settings.max_gpu_memory)
        ref = self.remote.options(num_cpus=self.cpus, num_gpus=1 if is_gpu(self.plan.options.device) else 0,
                                  memory=self._memory(shard), max_retries=RAY_RETRIES,
                                  retry_exceptions=False).remote(task, self.shared)
        self.inflight[ref] = (shard, reissued)
        return True

    def _memory(self, shard: ShardPlan) -> int:
        """What a task of ``shard`` declares (Ray admits tasks on a node by it): torch, plus the largest units the
        pipeline holds at once, twice (in flight and queued to the writer); never more than the largest node has."""
        units = sorted((estimate_bytes(tp, self.plan.method_of(tp))
                        for tp in (self.plan.tensors[name] for name in shard.tensors)), reverse=True)
        need = IMPORT_RESERVE + 2 * sum(units[:CONCURRENCY])
        return min(need, self.largest_memory) if self.largest_memory else need

    def _collect(self, ref: Any) -> None:
        shard, reissued = self.inflight.pop(ref)
        exceptions = self.ray.exceptions
        try:
            result: ShardDone = self.ray.get(ref)
        except exceptions.RayTaskError as exc:  # the task raised (and deleted its temp file): the run stops
            cause = exc.cause
            raise (cause if isinstance(cause, Exception) else exc) from None
        except exceptions.RayError as exc:  # its worker or node was lost beyond Ray's retries
            if reissued >= REISSUES:
                raise UnreachableError(f"the Ray cluster lost every worker that computed {shard.name}: {exc}",
                                       hint="check the cluster's nodes, then run resumerge resume OUT") from None
            self.job.reporter.message(f"{shard.name}: its worker was lost; computing it again")
            self._submit(shard, reissued + 1)
            return
        self._publish(shard, result)

    def _publish(self, shard: ShardPlan, result: ShardDone) -> None:
        """Publish the shard a task wrote through the run's sink and journal it, as the local writer does."""
        job, temp = self.job, Path(result.temp)
        job.reporter.shard_started(shard.name, shard.file_size, len(shard.tensors))
        if job.sink.commits_later:
            job.sink.commit_when(shard.name, self._checked_now(shard))
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
        """Delete what lost attempts left in the temp folders once every shard is published: the partial temp files
        of tasks whose node died mid-write (a resume would delete them too, later)."""
        names = {shard.name for shard in self.plan.shards}
        for folder in self.folders:
            for leftover in folder.iterdir():
                if is_temp_name(leftover.name, names) and leftover not in self.published:
                    discard(leftover)

    def _cancel(self) -> None:
        """Cancel the tasks still running (a stopped or failed run); their temp files are deleted by the tasks, or
        by the resume when a task could not."""
        for ref in self.inflight:
            self.ray.cancel(ref)
        self.inflight.clear()

"""A cluster node's long-lived worker: the engine's own pipeline over the stream of shards the driver feeds it.

The driver starts one :class:`ShardStream` actor per node (per share of its CPUs) with the frozen plan and the
run's settings (:class:`WorkerSetup`), or starts it warm, before the plan exists, and gives it both by
:meth:`ShardStream.begin` (:mod:`~resumerge.machine.cluster.launch`); then it feeds it shards, a few ahead
(:meth:`ShardStream.compute`: a shard's name and the folder its temp file goes to, never tensors). The actor runs
:func:`~resumerge.merge.engine.executor.compute_shards` once, over those shards as they come, so one shard's write
overlaps the next one's compute as in a local run, and torch is imported once per node, not per shard. Each call
returns its shard's :class:`ShardDone` (the written temp file's size and digest). The actor publishes nothing and
journals nothing: the driver publishes the temp file through the run's sink and records it, as the local executor
does with its writer's files. For a hub OUT (``WorkerSetup.upload``) the worker uploads each shard it wrote to the
repo's storage itself, deletes it and hands back the upload's reference: the driver only commits
(:mod:`~resumerge.merge.engine.cluster.upload`). Hub inputs the driver streams, the worker streams too, from the hub
(:mod:`~resumerge.merge.engine.cluster.hubreads`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.machine.checksums import SHA256, Checksum
from resumerge.machine.durable import discard, temp_path
from resumerge.machine.rayconnect import this_node
from resumerge.machine.torch_import import load, torch
from resumerge.merge.engine.cluster.cores import Cores, node_cores
from resumerge.merge.engine.cluster.hubreads import NodeReads, NodeSources, ReadDigest
from resumerge.merge.engine.devices import gpu_governor, make_governor, set_torch_threads
from resumerge.merge.engine.executor import Computing, Stopped, compute_shards
from resumerge.merge.engine.quiet import NullReporter
from resumerge.merge.methods.resources import Resources
from resumerge.merge.plan.merge_plan import Plan, ShardPlan
from resumerge.merge.plan.planner import threads_matter
from resumerge.merge.store.sink import LocalDirSink, Receipt

# A hub OUT's upload (huggingface_hub: most of a second of a worker's start) is imported by the workers that upload.
if TYPE_CHECKING:
    from resumerge.merge.engine.cluster.upload import HubPlace, Uploaded


# What every node's worker is given once: the run's frozen plan and resources (in Ray's object store).
Shared = tuple[Plan, Resources]


@dataclass(frozen=True)
class WorkerSetup:
    """What every shard of a node's worker shares besides the plan: the run's thread count (every node computes
    with it where the bytes of the plan's methods depend on it), the run's budgets (None: the node's own default)
    and, for a hub OUT, where the worker uploads the shards it writes (their folder is then on the node's own disk,
    made when missing), the hub inputs it streams, and the CPUs the worker declared to Ray (what it computes with
    where the bytes do not depend on the count: :func:`~resumerge.merge.engine.cluster.cores.node_cores`; None: the
    run's thread count), and what the worker hashes its shards with (the driver's journal's:
    :mod:`resumerge.machine.checksums`; sha256, which every sink can record, where none is given)."""

    threads: int
    max_memory: int | None = None
    max_gpu_memory: int | None = None
    upload: HubPlace | None = None
    reads: NodeReads | None = None
    cpus: int | None = None
    checksum: Checksum = SHA256

    def on_node(self, width: int, count: int) -> WorkerSetup:
        """This setup for one of ``count`` workers of a node, each ``width`` CPUs wide: the CPUs it computes with where
        the bytes do not depend on the thread count, and the node's fetch cache split between them."""
        return replace(self, cpus=width, reads=None if self.reads is None else self.reads.shared_by(count))


@dataclass(frozen=True)
class ShardDone:
    """A shard written by a node's worker: its temp file, size and sha256, its tensors in data order, how long its
    writer took, and which node made it (filled in by the driver, which placed the worker); for a hub OUT, no temp
    file but the reference of the worker's upload; the streamed ranges the node read since its last shard (their
    digests, for the driver's ledger) and the bytes it fetched from the hub meanwhile; what the worker computed it
    with (torch's threads as torch reports them, and the units at once), and the worker's process (a kept worker
    serves many runs)."""

    shard: str
    temp: str
    size: int
    sha256: str
    tensors: tuple[str, ...]
    seconds: float
    node: str = ""
    uploaded: Uploaded | None = None
    reads: tuple[ReadDigest, ...] = ()
    fetched: int = 0
    cores: Cores | None = None
    pid: int = 0


class _HandOver(LocalDirSink):
    """The worker's sink: each shard goes to the temp path chosen when it was fed, and "publishing" it only hands it
    back (the driver publishes it through the run's real sink)."""

    def __init__(self, temps: dict[str, Path]) -> None:
        super().__init__(Path("."))
        self.temps = temps

    def temp_for(self, name: str) -> Path:
        return self.temps[name]

    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        return Receipt.committed(name)


class ShardStream:
    """A node's worker (a threaded Ray actor: :meth:`compute` calls wait side by side). Its pipeline thread starts
    with the first shard fed and runs until :meth:`stop`, or until a shard fails: every waiting call then raises
    that error (the local run's), and the next shard fed starts a fresh pipeline.

    A worker started warm (``shared`` and ``setup`` None) imports torch as it starts, while its driver plans, and
    computes nothing until :meth:`begin` gives it both: a shard fed before waits for it, and raises what
    :meth:`begin` raised."""

    def __init__(self, shared: Shared | None, setup: WorkerSetup | None) -> None:
        self.begun = threading.Event()  # set once begun (or failed to), or stopped
        self.failed: BaseException | None = None  # what begin raised
        self.plan: Plan | None = None
        self.resources: Resources | None = None
        self.shards: dict[str, ShardPlan] = {}
        self.setup = setup  # None until begun, for a warm worker
        self.cores: Cores | None = None  # what it computes with, once begun
        if shared is None or setup is None:
            load()  # torch now, while the driver plans, not with the first shard fed (begin sets its threads)
        else:
            self.begin(shared, setup)
        self.lock = threading.Lock()
        self.fed: queue.Queue[str | None] = queue.Queue()
        self.waiting: dict[str, tuple[Path, Future[ShardDone]]] = {}  # fed, not yet written: temp path, result
        self.temps: dict[str, Path] = {}
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None  # the pipeline's, while it runs
        self.node: NodeSources | None = None  # the pipeline's sources, while it runs

    def compute(self, shard: str, folder: str) -> ShardDone:
        """Compute and write ``shard`` to a fresh temp file in ``folder`` (each attempt its own: a re-issue never
        meets a lost attempt's file) after the shards fed before it; returns its digests. Raises what the local
        executor would raise for it (a bad input found late, a full disk), or :class:`Stopped` once stopped; a
        shard that does not finish leaves no temp file."""
        self.begun.wait()
        result: Future[ShardDone] = Future()
        with self.lock:
            if self.failed is not None:
                raise self.failed
            if self.stopping.is_set():
                raise Stopped()
            assert self.setup is not None  # begun (a failed or stopped start raised above)
            if self.setup.upload is not None:
                Path(folder).mkdir(parents=True, exist_ok=True)
            temp = temp_path(Path(folder) / shard)
            self.temps[shard] = temp
            self.waiting[shard] = (temp, result)
            self.fed.put(shard)
            if self.thread is None:
                self.thread = threading.Thread(target=self._pipeline, name="resumerge-node-pipeline", daemon=True)
                self.thread.start()
        return result.result()

    def begin(self, shared: Shared, setup: WorkerSetup) -> None:
        """The run's frozen plan and resources, and its shards' setup (thread count, budgets, upload place, hub
        reads): what a warm worker waits for before it computes. A raise here is also every shard's fed to it."""
        try:
            self.plan, self.resources = shared
            self.setup = setup
            self.shards = {shard.name: shard for shard in self.plan.shards}
            self.cores = node_cores(setup.threads, setup.cpus or setup.threads, thread_dependent=threads_matter(
                {t.method for t in self.plan.tensors.values()}, self.plan.units))
            set_torch_threads(self.cores.threads)
        except BaseException as exc:
            self.failed = exc
            raise
        finally:
            self.begun.set()

    def stop(self) -> None:
        """End the pipeline at its next safe point (the shard it was writing abandoned, its temp file deleted); the
        calls still waiting raise :class:`Stopped` (those of a worker never begun too). Returns once it ended."""
        with self.lock:
            self.stopping.set()
            self.fed.put(None)
            thread = self.thread
        self.begun.set()
        if thread is not None:
            thread.join()

    def _pipeline(self) -> None:
        plan, resources, cores, setup = self.plan, self.resources, self.cores, self.setup
        # Begun before any shard was fed.
        assert plan is not None and resources is not None and cores is not None and setup is not None
        governor = make_governor(plan, setup.max_memory)
        gpu = gpu_governor(plan, plan.options.device, setup.max_gpu_memory)
        governor.start()
        if gpu is not None:
            gpu.start()
        error: BaseException = Stopped()
        self.node = None
        try:
            self.node = NodeSources(plan, setup.reads, governor, this_node() if setup.reads else "")
            computing = Computing(self.stopping.is_set, resources, cores.units, governor, gpu)
            compute_shards(plan, self.node.sources, _HandOver(self.temps), self, NullReporter(), set(self.shards),
                           computing, batches=self._batches())
        except BaseException as exc:
            error = exc
        finally:
            if self.node is not None:
                self.node.close()  # its sources, and the node's fetch cache
            governor.stop()
            if gpu is not None:
                gpu.stop()
        with self.lock:
            self.thread = None
            for temp, result in self.waiting.values():
                discard(temp)
                result.set_exception(error)
            self.waiting.clear()
            while not self.fed.empty():
                self.fed.get_nowait()

    def _batches(self) -> Iterator[list[ShardPlan]]:
        """The shards fed so far, a batch at a time (a batch's last units reach the writer before the next one is
        awaited); ends at :meth:`stop`."""
        while True:
            batch = [self.fed.get()]
            while not self.fed.empty():
                batch.append(self.fed.get_nowait())
            if None in batch:
                return
            shards = [self.shards[name] for name in batch if name is not None]
            if self.node is not None:
                self.node.expect(shards)
            yield shards

    # The pipeline's journal: a written shard's digests answer the call that fed it.
    @property
    def checksum(self) -> Checksum:
        """What the writer hashes each shard with: the driver's journal's (begun before any shard is fed)."""
        assert self.setup is not None
        return self.setup.checksum

    def record(self, receipt: Receipt, size: int, sha256: str, *, seconds: float = 0.0,
               tensors: tuple[str, ...] = (), manifest_point: bool = True) -> None:
        """The writer wrote ``receipt.name``: its call returns (for a hub OUT once this node uploaded it; the writer
        waits meanwhile, so the node stages one shard at a time)."""
        with self.lock:
            temp, result = self.waiting.pop(receipt.name)
        reads, fetched = self.node.drain() if self.node is not None else ((), 0)
        assert self.cores is not None and self.setup is not None  # begun before any shard was fed
        cores = Cores(torch.get_num_threads(), self.cores.units)
        place = self.setup.upload
        if place is None:
            result.set_result(ShardDone(receipt.name, str(temp), size, sha256, tensors, seconds, reads=reads,
                                        fetched=fetched, cores=cores, pid=os.getpid()))
            return
        from resumerge.merge.engine.cluster.upload import upload_shard

        try:
            uploaded = upload_shard(place, temp, receipt.name, sha256)
        except BaseException as exc:
            result.set_exception(exc)
            raise
        finally:
            discard(temp)  # uploaded or failed: the node keeps nothing
        result.set_result(ShardDone(receipt.name, "", size, sha256, tensors, seconds, uploaded=uploaded, reads=reads,
                                    fetched=fetched, cores=cores, pid=os.getpid()))

    def settle(self, *, strict: bool = True) -> None:
        """Nothing waits: the driver commits."""

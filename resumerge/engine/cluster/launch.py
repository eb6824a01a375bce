"""How a Ray run's workers start: a :class:`~resumerge.engine.cluster.worker.ShardStream` actor per share of every
node's CPUs, declaring the CPUs, GPU and memory its shards need, pinned to its node.

A worker's start is a fresh process importing the engine and torch, seconds that the driver would otherwise wait
for. So a run that joins a running cluster starts its workers *warm*, before its plan exists (:func:`warm_workers`,
from the background join of :func:`~resumerge.engine.cluster.connect.join_soon`): each declares its CPUs (the
thread count the run will use) and the memory torch takes, and imports while the driver plans. Once the plan is
known, :meth:`Launch.adopt` hands them the frozen plan and their setup and reserves the rest of each one's memory on
its node (a placement group), so the declarations add up to a worker started afterwards (:meth:`Launch.start`).
Warm workers that do not fit the plan (another width, a GPU run) are ended and the plan's own started.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psutil

from resumerge.config.settings import RunSettings
from resumerge.engine.cluster.hubreads import NodeReads
from resumerge.engine.cluster.upload import HubPlace, task_cpus
from resumerge.engine.cluster.worker import ShardStream, WorkerSetup
from resumerge.engine.devices import is_gpu
from resumerge.engine.executor import CONCURRENCY
from resumerge.errors import UnreachableError
from resumerge.methods.registry import get_method
from resumerge.methods.resources import Resources
from resumerge.plan.merge_plan import Plan, ShardPlan
from resumerge.plan.workunits import estimate_bytes
from resumerge.torch_import import IMPORT_RESERVE, torch

# How many shards the driver keeps fed to each node's worker: one computing while the one before is written.
AHEAD = 2


@dataclass(eq=False)
class Worker:
    """A node's worker as the driver sees it: its actor, its node (the short id the ledger names, and the full
    one), the CPUs it declared, its shards fed, and for a warm worker the placement group holding the rest of its
    memory."""

    actor: Any
    node: str
    node_id: str
    width: int
    fed: int = 0
    reserved: Any = None


def end(ray: ModuleType, workers: Iterable[Worker]) -> None:
    """End ``workers``' actors and free what they reserved."""
    from ray.util.placement_group import remove_placement_group

    for worker in workers:
        ray.kill(worker.actor, no_restart=True)
        if worker.reserved is not None:
            remove_placement_group(worker.reserved)
            worker.reserved = None


def default_threads(threads: int | None) -> int:
    """The thread count of a run's workers as far as it is known before the plan: ``threads`` (``-j``), else the
    machine's physical cores (what torch takes by default, read without importing it)."""
    return threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1


def warm_workers(ray: ModuleType, threads: int | None) -> list[Worker]:
    """Workers started before the run's plan exists, on every live node with a CPU: each declares the run's thread
    count (``-j``, None: :func:`default_threads`) in CPUs and the memory torch takes, and waits for
    :meth:`Launch.adopt` (none when the cluster has no node to compute on: the run's own start says so)."""
    threads = default_threads(threads)
    try:
        return _place(ray, ray.nodes(), None, WorkerSetup(threads), threads, IMPORT_RESERVE, gpu=False, lost=set())
    except UnreachableError:
        return []


@dataclass(frozen=True)
class Launch:
    """How a run's workers start: the plan and the run's resources (in Ray's object store, once), the setup every
    worker gets, the memory each declares, and for a hub OUT under ``--max-disk`` what a node may stage (its
    largest shard, the budget)."""

    plan: Plan
    shared: Any
    setup: WorkerSetup
    memory: int
    staging: tuple[int, int] | None = None

    @classmethod
    def of(cls, ray: ModuleType, plan: Plan, resources: Resources, settings: RunSettings, shards: Iterable[ShardPlan],
           upload: HubPlace | None = None, max_disk: int | None = None, reads: NodeReads | None = None) -> Launch:
        """The launch of ``plan``'s workers for ``shards`` (the memory they declare is the largest's need), which
        upload to ``upload`` (a hub OUT) and stream ``reads`` (hub inputs)."""
        setup = WorkerSetup(settings.num_threads or _threads(plan, settings), settings.max_memory,
                            settings.max_gpu_memory, upload, reads)
        memory = max((_memory(plan, shard) for shard in shards), default=IMPORT_RESERVE)
        largest = max((s.file_size for s in plan.shards), default=0)
        return cls(plan, ray.put((plan, resources)), setup, memory,
                   None if upload is None or max_disk is None else (largest, max_disk))

    def start(self, ray: ModuleType, lost: set[str]) -> list[Worker]:
        """An actor on every live node with a CPU (a GPU with ``--device cuda``) not ``lost``, one per share of the
        node's CPUs as wide as the run's thread count; each declares those CPUs and the memory the plan's largest
        shard needs (at most what its node has). Raises :class:`UnreachableError` when no node is left. The actors
        import torch and the engine as they start, while the driver goes on."""
        nodes = ray.nodes()
        return _place(ray, nodes, self.shared, self.setup, self._width(nodes), self.memory,
                      gpu=is_gpu(self.plan.options.device), lost=lost)

    def adopt(self, ray: ModuleType, warm: list[Worker]) -> bool:
        """Give the ``warm`` workers this launch's plan and setup, and reserve on each one's node the memory it
        needs beyond torch's; False (nothing done) when they do not fit it: none, a GPU run, another width."""
        from ray.util.placement_group import placement_group

        nodes = ray.nodes()
        wanted, has = self._width(nodes), {n.get("NodeID", ""): n.get("Resources", {}) for n in nodes}
        if not warm or is_gpu(self.plan.options.device) or any(
                w.width != min(wanted, int(has.get(w.node_id, {}).get("CPU", 0))) for w in warm):
            return False
        memory = {node_id: int(resources.get("memory", 0)) for node_id, resources in has.items()}
        for worker in warm:
            rest = (min(self.memory, memory.get(worker.node_id, 0)) or self.memory) - IMPORT_RESERVE
            if rest > 0:
                worker.reserved = placement_group([{"memory": rest}], strategy="STRICT_PACK",
                                                  _soft_target_node_id=worker.node_id)
            worker.actor.begin.remote(self.shared, self.setup)
        return True

    def _width(self, nodes: list[dict[str, Any]]) -> int:
        """The CPUs each worker declares: the run's thread count, raised for a hub OUT under ``--max-disk`` so that no
        node runs more workers than it may stage shards (each stages one at a time until uploaded)."""
        if self.staging is None:
            return self.setup.threads
        cpus = [n.get("Resources", {}).get("CPU", 0) for n in nodes if n.get("Alive")]
        return task_cpus(self.setup.threads, cpus, self.staging[1], self.staging[0])


def _place(ray: ModuleType, nodes: list[dict[str, Any]], shared: Any, setup: WorkerSetup, wanted: int, memory: int,
           *, gpu: bool, lost: set[str]) -> list[Worker]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_class = ray.remote(ShardStream)
    workers = []
    for node in nodes:
        has, node_id = node.get("Resources", {}), node.get("NodeID", "")
        cpus = int(has.get("CPU", 0))
        if not node.get("Alive") or node_id[:8] in lost or cpus < 1 or (gpu and has.get("GPU", 0) < 1):
            continue
        width = min(wanted, cpus)
        count = min(cpus // width, int(has["GPU"])) if gpu else cpus // width
        declared = min(memory, int(has.get("memory", 0))) or memory
        for _ in range(count):
            actor = actor_class.options(
                num_cpus=width, num_gpus=1 if gpu else 0, memory=declared, max_restarts=0,
                max_concurrency=AHEAD + 2,  # the shards fed and waiting, and a call to stop
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(shared, setup)
            workers.append(Worker(actor, node_id[:8], node_id, width))
    if not workers:
        raise UnreachableError("the Ray cluster has no live node to compute on" + (" with a GPU" if gpu else ""),
                               hint="check the cluster's nodes, then run resumerge resume OUT")
    return workers


def _memory(plan: Plan, shard: ShardPlan) -> int:
    """What a worker computing ``shard`` needs: torch, plus the largest units the pipeline holds at once, twice (in
    flight and queued to the writer)."""
    units = sorted((estimate_bytes(tp, plan.method_of(tp)) for tp in (plan.tensors[name] for name in shard.tensors)),
                   reverse=True)
    return IMPORT_RESERVE + 2 * sum(units[:CONCURRENCY])


def _threads(plan: Plan, settings: RunSettings) -> int:
    """The thread count of every node's workers for a run without ``-j``: this process's torch's own count where a
    method's bytes depend on it (as a local run computes), else :func:`default_threads`, without importing torch
    here (the driver computes nothing: its import would be two CPU seconds beside the workers' own)."""
    specs = [get_method(name) for name in {plan.method, *(tp.method for tp in plan.tensors.values())}]
    if any(spec is None or spec.thread_dependent for spec in specs):
        return int(torch.get_num_threads())
    return default_threads(settings.num_threads)

"""How a Ray run's workers start: a :class:`~resumerge.merge.engine.cluster.worker.ShardStream` per share of every
node's CPUs (in a :class:`~resumerge.machine.cluster.actor.NodeActor`), pinned to its node, declaring the CPUs, GPU
and memory its shards need.

A worker's start is a fresh process importing the engine and torch: seconds that a driver would wait for once it
has planned. So a run whose API call can name its cluster starts its workers *warm*, while it plans
(:mod:`~resumerge.merge.engine.cluster.warm`): :func:`place` without a plan, each worker declaring its CPUs and the
memory its imports take; this module imports nothing of the engine, so a warm start places its workers as soon as it has
joined the cluster. Once the plan is known, :func:`adopt` reserves the rest of each one's memory on its node (a
placement group pinned there by the node's ``ray.io/node-id`` label), waits up to :data:`RESERVE_SECONDS` for every
reservation, and only then hands the workers the plan
(:meth:`~resumerge.merge.engine.cluster.worker.ShardStream.begin`), so no worker computes on memory Ray has not set
aside for it. Warm workers that do not fit the plan (another thread count, a GPU run, a node come or gone) or whose
reservation does not come up are not adopted: the run ends them (:func:`end`, which removes their reservations too) and
places its own, which declare all their memory themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import psutil

from resumerge.errors import UnreachableError
from resumerge.machine.cluster.actor import NodeActor
from resumerge.machine.torch_import import IMPORT_RESERVE

# How many shards the driver keeps fed to each node's worker: one computing while the one before is written.
AHEAD = 2
# How long the driver waits for the warm workers' memory reservations before it ends them and starts its own.
RESERVE_SECONDS = 10.0
# The label every Ray node carries with its id: what pins a placement group's bundle to a node (public API, unlike
# the soft target hint).
NODE_LABEL = "ray.io/node-id"


@dataclass(eq=False)
class Worker:
    """A node's worker as the driver sees it: its actor, its node (the short id the ledger names, and the full one),
    the CPUs it declared, its shards fed; for a warm worker, the placement group holding the rest of its memory and
    the reference of its :meth:`~resumerge.merge.engine.cluster.worker.ShardStream.begin` call (checked by the driver);
    for a kept worker, the token of its lease."""

    actor: Any
    node: str
    node_id: str
    width: int
    fed: int = 0
    reserved: Any = None
    begun: Any = None
    # a kept worker's lease (:mod:`~resumerge.machine.cluster.kept`): released, killed on fallbacks
    token: Any = None


class NodeSetup(Protocol):
    """What every shard of a run's workers shares besides the plan (the merge's
    :class:`~resumerge.merge.engine.cluster.worker.WorkerSetup`), as each node's worker is given it."""

    def on_node(self, width: int, count: int) -> NodeSetup:
        """This setup for one of ``count`` workers of a node, each ``width`` CPUs wide."""


def default_threads(threads: int | None) -> int:
    """The thread count of a run's workers where the bytes do not depend on it: ``threads`` (``-j``), else the
    machine's physical cores (torch's own default, read without importing torch: the driver computes nothing)."""
    return threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1


def end(ray: ModuleType, workers: list[Worker], *, kill: bool = False) -> None:
    """End ``workers``' actors, or release the kept ones (their pipelines stopped, idle for the next run) unless
    ``kill`` (a fallback: a released worker would go on declaring its memory beside the run's fresh ones), and
    remove their reservations. A kept worker whose release does not answer within :data:`RESERVE_SECONDS` is killed:
    nothing of the run goes on after it."""
    released = {}
    for worker in workers:
        if worker.token is None or kill:
            ray.kill(worker.actor, no_restart=True)
        else:
            released[worker.actor.release.remote([worker.token])] = worker
    unreserve(workers)
    # Read (a dead worker's error included: Ray prints those nobody read).
    answered, late = ray.wait(list(released), num_returns=len(released), timeout=RESERVE_SECONDS) if released else (
        [], [])
    for ref in answered:
        try:
            ray.get(ref)
        except ray.exceptions.RayError:
            continue
    for ref in late:
        ray.kill(released[ref].actor, no_restart=True)


def unreserve(workers: list[Worker]) -> None:
    """Remove ``workers``' memory reservations (their placement groups)."""
    reserved = [worker for worker in workers if worker.reserved is not None]
    if not reserved:
        return
    from ray.util.placement_group import remove_placement_group

    for worker in reserved:
        remove_placement_group(worker.reserved)
        worker.reserved = None


def place(ray: ModuleType, nodes: list[dict[str, Any]], shared: Any, setup: NodeSetup | None, wanted: int,
          memory: int, *, gpu: bool, lost: set[str], stream: str) -> list[Worker]:
    """An actor on every live node with a CPU (a GPU when ``gpu``) not ``lost``, one per share of the node's CPUs
    ``wanted`` wide; each declares those CPUs and ``memory`` (at most what its node has) and is given ``shared``
    (the plan in the object store) and ``setup`` (both None: a warm worker, given them by :func:`adopt`), its
    stream made of the class named ``stream`` (:class:`~resumerge.machine.cluster.actor.NodeActor`). The
    actors import torch and the engine as they start, while the driver goes on. Raises :class:`UnreachableError`
    when no node is left; on any raise, the actors already made are ended."""
    actor_class = ray.remote(NodeActor)
    workers: list[Worker] = []
    try:
        for node_id, has, width, count in layout(nodes, wanted, gpu=gpu, lost=lost):
            for _ in range(count):
                actor = actor_class.options(
                    num_cpus=width, num_gpus=1 if gpu else 0, memory=declared(memory, has), max_restarts=0,
                    max_concurrency=AHEAD + 3,  # the shards fed and waiting, begin, and a call to stop
                    scheduling_strategy=pinned(node_id),
                ).remote(shared, None if setup is None else setup.on_node(width, count), stream=stream)
                workers.append(Worker(actor, node_id[:8], node_id, width))
    except BaseException:
        end(ray, workers)
        raise
    if not workers:
        raise UnreachableError("the Ray cluster has no live node to compute on" + (" with a GPU" if gpu else ""),
                               hint="check the cluster's nodes, then run resumerge resume OUT")
    return workers


def adopt(ray: ModuleType, warm: list[Worker], nodes: list[dict[str, Any]], shared: Any, setup: NodeSetup,
          wanted: int, memory: int) -> bool:
    """Give the ``warm`` workers (placed without a plan, ``wanted`` CPUs wide) the plan ``shared`` and ``setup``
    once the rest of the ``memory`` each needs beyond its imports (and a kept worker's CPUs) is reserved on its
    node; each one's ``begun`` is then its begin call's reference. False, with no worker begun, when they do not
    fit (the nodes' layout changed, or another width) or a reservation did not come up within
    :data:`RESERVE_SECONDS`: the caller ends them (and what they reserved)."""
    from ray.util.placement_group import placement_group

    shape = {node_id: (has, width, count) for node_id, has, width, count in layout(nodes, wanted, gpu=False,
                                                                                    lost=set())}
    placed: dict[str, int] = {}
    for worker in warm:
        placed[worker.node_id] = placed.get(worker.node_id, 0) + 1
    if not warm or placed != {node_id: count for node_id, (_, _, count) in shape.items()} or any(
            worker.width != shape[worker.node_id][1] for worker in warm):
        return False
    for worker in warm:
        has = shape[worker.node_id][0]
        rest = declared(memory, has) - declared(IMPORT_RESERVE, has)
        # A kept worker declares no CPU (it holds none while idle): the run reserves those it computes with.
        bundle = {"memory": rest} if rest > 0 else {}
        if worker.token is not None:
            bundle["CPU"] = worker.width
        if bundle:
            worker.reserved = placement_group([bundle], strategy="STRICT_PACK",
                                              bundle_label_selector=[{NODE_LABEL: worker.node_id}])
    waits = [worker.reserved.ready() for worker in warm if worker.reserved is not None]
    if waits and len(ray.wait(waits, num_returns=len(waits), timeout=RESERVE_SECONDS)[0]) < len(waits):
        return False
    for worker in warm:
        worker.begun = worker.actor.begin.remote(shared, setup.on_node(worker.width, placed[worker.node_id]))
    return True


def fit(warm: list[Worker], nodes: list[dict[str, Any]], wanted: int) -> tuple[list[Worker], list[Worker]]:
    """The ``warm`` workers a run ``wanted`` CPUs wide per worker can adopt, and those it leaves spare (the caller
    releases them). A kept worker declares no CPU (the run reserves those it computes with: :func:`adopt`), so it
    serves any width: a run whose workers are wider than the warm start's (a hub OUT under ``--max-disk``, whose
    width the plan's shard size sets) takes the first of each node's as many as its layout has there. Workers that
    are not kept declared their width as they started: returned as they are, none spare."""
    if not warm or any(worker.token is None for worker in warm):
        return warm, []
    shape = {node_id: (width, count) for node_id, _, width, count in layout(nodes, wanted, gpu=False, lost=set())}
    taken: list[Worker] = []
    spare: list[Worker] = []
    for worker in warm:
        width, count = shape.get(worker.node_id, (0, 0))
        if sum(1 for other in taken if other.node_id == worker.node_id) < count:
            worker.width = width
            taken.append(worker)
        else:
            spare.append(worker)
    return taken, spare


def pinned(node_id: str) -> Any:
    """The scheduling strategy that places an actor on the node ``node_id`` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def layout(nodes: list[dict[str, Any]], wanted: int, *, gpu: bool,
            lost: set[str]) -> Iterator[tuple[str, Mapping[str, float], int, int]]:
    """(node id, its resources, each worker's CPUs, how many workers) of every live node that computes."""
    for node in nodes:
        has, node_id = node.get("Resources", {}), node.get("NodeID", "")
        cpus = int(has.get("CPU", 0))
        if not node.get("Alive") or node_id[:8] in lost or cpus < 1 or (gpu and has.get("GPU", 0) < 1):
            continue
        width = min(wanted, cpus)
        yield node_id, has, width, min(cpus // width, int(has["GPU"])) if gpu else cpus // width


def declared(memory: int, has: Mapping[str, float]) -> int:
    """The memory a worker declares on a node with resources ``has``: ``memory``, at most what the node has."""
    return min(memory, int(has.get("memory", 0))) or memory

"""Kept workers: a node's worker that outlives its run, leased by the next run on the same cluster (or the resume
after a kill), which then computes as soon as it has planned instead of waiting for a fresh process to import Ray,
the engine and torch (3.5-4 CPU seconds a worker).

Only a run on a cluster that outlives it keeps its workers: one joined at ``--ray-address`` or ``RAY_ADDRESS``, or the
one its process is connected to (the warm start's clusters, :mod:`~resumerge.merge.engine.cluster.warm`); never a Ray
started for the run, nor a GPU run (an idle process would hold the GPU). A kept worker is a detached, named
:class:`~resumerge.machine.cluster.actor.NodeActor` in the :data:`NAMESPACE` namespace, one per (node, slot), named
with the digest of the code it runs and its job's runtime_env
(:func:`~resumerge.machine.cluster.keeper.run_digest`), so a worker never serves a run of other code or another
runtime_env (and checks that digest against its own as it starts, ending once it said so to the lease that made it where
another node's code differs, and at every lease). Idle, it declares no CPU, only the memory its imports take; the run
that leases it reserves the CPUs it computes with and the rest of its memory by a placement group pinned to its node
(:func:`~resumerge.machine.cluster.launch.adopt`), removed when the run ends.

A lease is a token the driver ``ray.put``s (the driver owns it): while the driver lives no other run takes the
worker (that run asks the node's next slot); once it died (``OwnerDiedError`` on the token) the worker stops the
dead run's pipeline at its next safe point, its temp files deleted, before it serves anyone, and a watchdog in the
worker does so on its own (:class:`~resumerge.machine.cluster.keeper.Keeper`). Its delay, stated here only: about
two seconds after the driver's death (Ray's notice that the token's owner died, then the watchdog's next turn),
plus the wait for the dead run's pipeline to reach its safe point (a hub upload's can be minutes away: the worker
waits for it at most :data:`~resumerge.machine.cluster.keeper.RENEW_SECONDS`, then ends itself). With a ``ray://``
address the token belongs to the proxy driver on the head node, which outlives a killed client for Ray Client's
reconnect grace (about 30 s): the worker is freed that much later. A kept worker idle for ``--keep-workers`` ends
itself, which frees its name. A kept worker hosts a forward pass's actor too, under the same lease
(:func:`lease_on`, :mod:`~resumerge.machine.cluster.hosting`): one kept process per (node, slot) serves a merge's
shards or a check's, measure's, eval's or evolve's pass, one lease at a time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from resumerge.machine.cluster.actor import NodeActor
from resumerge.machine.cluster.keeper import OTHER_CODE, run_digest
from resumerge.machine.cluster.launch import AHEAD, RESERVE_SECONDS, Worker, declared, end, layout, pinned
from resumerge.machine.torch_import import IMPORT_RESERVE

# The namespace of every kept worker's name.
NAMESPACE = "resumerge"
# How long a run waits for its kept workers' answers to its leases, every node's together; one that has not
# answered by then is killed (stuck, or never scheduled).
LEASE_SECONDS = 60.0
# How long it waits for a worker it made for the lease: one answers once its process has imported Ray, the engine
# and torch (seconds) and was scheduled; one that pends (its node has no memory free: another run's workers hold it)
# would stall the run's start the whole LEASE_SECONDS, where fresh workers placed by the run wait for memory no
# longer than the warm ones' reservations (RESERVE_SECONDS).
NEW_LEASE_SECONDS = 10.0 + RESERVE_SECONDS
# The slots past a node's own that a run tries when live runs hold those (each its own kept worker).
SPARE_SLOTS = 2


def kept_name(code: str, node_id: str, slot: int) -> str:
    """The name of the kept worker of ``slot`` on the node ``node_id`` that runs the code of digest ``code``."""
    return f"worker-{code}-{node_id[:16]}-{slot}"


def lease(ray: ModuleType, nodes: list[dict[str, Any]], wanted: int, keep: float,
          stream: str) -> tuple[list[Worker], int, int]:
    """A kept worker leased on every live node with a CPU, one per share of its CPUs ``wanted`` wide, each made
    (detached, idle for at most ``keep`` seconds once released, its stream of the class named ``stream``) where the node
    has none that this process's code runs and no live run holds; how many of them served a run before; and how many
    workers refused the lease for running other code or another runtime_env
    (:data:`~resumerge.machine.cluster.keeper.OTHER_CODE`). Every node's slots are asked at once and answered
    within one :data:`LEASE_SECONDS` deadline (a worker made for the lease within :data:`NEW_LEASE_SECONDS` of its ask);
    a node whose slots live runs hold is asked its next ones, up to
    :data:`SPARE_SLOTS` more, a new worker only while the cluster has the memory it declares free; a node whose
    worker runs other code is asked no more (each worker made there, a process importing torch, would run it too).
    A worker ``wanted`` wide once its run reserved its CPUs (:func:`~resumerge.machine.cluster.launch.adopt`);
    ended (:func:`~resumerge.machine.cluster.launch.end`) it is released. On any raise, the leases already taken
    are released."""
    return _leased(ray, {node_id: _Node(has, width, count, 0, count + SPARE_SLOTS) for node_id, has, width, count
                         in layout(nodes, wanted, gpu=False, lost=set())}, keep, stream)


def lease_on(ray: ModuleType, nodes: list[dict[str, Any]], counts: Mapping[str, int], keep: float,
             stream: str) -> tuple[list[Worker], int, int]:
    """As :func:`lease`, ``counts[node]`` kept workers on each live node named there (a forward pass's actors:
    :mod:`~resumerge.machine.cluster.hosting`), each one CPU wide as the driver sees it (the pass reserves the CPUs
    it computes with itself); fewer where live runs hold the node's slots and its spare ones."""
    alive = {node["NodeID"]: node.get("Resources", {}) for node in nodes if node.get("Alive")}
    return _leased(ray, {node_id: _Node(alive[node_id], 1, count, 0, count + SPARE_SLOTS)
                         for node_id, count in counts.items() if node_id in alive and count > 0}, keep, stream)


def _leased(ray: ModuleType, todo: dict[str, _Node], keep: float, stream: str) -> tuple[list[Worker], int, int]:
    """:func:`lease`'s work, for the workers ``todo`` says on each node."""
    code = run_digest(ray)
    token = ray.put(code)  # owned by this process: the lease ends with it
    actor_class = ray.remote(NodeActor)
    deadline = time.monotonic() + LEASE_SECONDS
    workers: list[Worker] = []
    reused = other = 0
    try:
        while asks := _slots(ray, todo, code):
            now = time.monotonic()
            deadlines = [deadline if exists else min(deadline, now + NEW_LEASE_SECONDS) for _, _, exists in asks]
            asked = [(node_id, actor_class.options(
                name=kept_name(code, node_id, slot), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, memory=declared(IMPORT_RESERVE, todo[node_id].has), max_restarts=0,
                max_concurrency=AHEAD + 5,  # as a run's worker, and the lease's calls
                scheduling_strategy=pinned(node_id)).remote(None, None, keep, code, stream=stream))
                     for node_id, slot, _ in asks]
            answers = [actor.lease.remote([token], code, keep) for _, actor in asked]
            for (node_id, actor), served in zip(asked, _answers(ray, asked, answers, deadlines), strict=True):
                other += served == OTHER_CODE
                if served == OTHER_CODE:  # the node runs other code: a worker made at its next slot would too
                    todo[node_id].last = todo[node_id].slot
                if served is not None and served != OTHER_CODE:
                    workers.append(Worker(actor, node_id[:8], node_id, todo[node_id].width, token=token))
                    reused += served > 0
                    todo[node_id].needed -= 1
    except BaseException:
        end(ray, workers)
        raise
    return workers, reused, other


@dataclass
class _Node:
    """A node's leases under way: its resources, each worker's CPUs, the workers still needed, the next slot to ask
    and the slot past the last one it may ask."""

    has: Mapping[str, float]
    width: int
    needed: int
    slot: int
    last: int


def _slots(ray: ModuleType, todo: dict[str, _Node], code: str) -> list[tuple[str, int, bool]]:
    """The next (node, slot, whether its kept worker lives) to ask on every node that still needs workers, its spare
    slots (past its own) only where a worker lives there already or the cluster has the memory free that a new one
    declares (Ray's per-node figure is not public: the cluster's bounds it)."""
    free = ray.available_resources().get("memory", 0.0)
    asks = []
    for node_id, node in todo.items():
        own = node.last - SPARE_SLOTS  # the slots before it are the node's own
        for _ in range(min(node.needed, node.last - node.slot)):
            exists = _exists(ray, kept_name(code, node_id, node.slot))
            if node.slot >= own and not exists:
                free -= declared(IMPORT_RESERVE, node.has)
                if free < 0:
                    node.last = node.slot  # no room for it, nor for the slots after it
                    break
            asks.append((node_id, node.slot, exists))
            node.slot += 1
    return asks


def _exists(ray: ModuleType, name: str) -> bool:
    """Whether a kept worker of that name lives."""
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def _answers(ray: ModuleType, asked: list[tuple[str, Any]], answers: list[Any],
             deadlines: list[float]) -> list[int | None]:
    """Kept workers' ``answers`` to leases, each waited for until its deadline: each the runs it served before, or
    None where it refused (a live run holds it, or it runs other code, or it ends), died, or did not answer in time
    (then it is killed: it was never scheduled, or is stuck)."""
    answered: set[Any] = set()
    for until in sorted(set(deadlines)):  # all together until the first deadline, then those given longer
        waiting = [answer for answer, last in zip(answers, deadlines, strict=True)
                   if last >= until and answer not in answered]
        if waiting:
            answered.update(ray.wait(waiting, num_returns=len(waiting), timeout=max(0.0, until - time.monotonic()))[0])
    served: list[int | None] = []
    for (_, actor), answer in zip(asked, answers, strict=True):
        if answer not in answered:
            ray.kill(actor, no_restart=True)
            served.append(None)
            continue
        try:
            served.append(ray.get(answer))
        except ray.exceptions.RayError:
            served.append(None)
    return served


"""Kept workers: a node's worker that outlives its run, leased by the next run on the same cluster (or the resume
after a kill), which then computes as soon as it has planned instead of waiting for a fresh process to import Ray,
the engine and torch (3.5-4 CPU seconds a worker).

Only a run on a cluster that outlives it keeps its workers: one joined at ``--ray-address`` or ``RAY_ADDRESS``, or
the one its process is connected to (the warm start's clusters, :mod:`~resumerge.engine.cluster.warm`); never a
Ray started for the run, nor a GPU run (an idle process would hold the GPU). A kept worker is a detached, named
:class:`~resumerge.engine.cluster.actor.NodeActor` in the :data:`NAMESPACE` namespace, one per (node, slot),
named with the digest of the code it runs (:func:`~resumerge.engine.cluster.keeper.code_digest`), so a worker
never serves a run of other code (and checks that digest against its own at every lease). Idle, it declares no
CPU, only the memory its imports take; the run that leases it reserves the CPUs it computes with and the rest of
its memory by a placement group pinned to its node (:func:`~resumerge.engine.cluster.launch.adopt`), removed when
the run ends.

A lease is a token the driver ``ray.put``s (the driver owns it): while the driver lives no other run takes the
worker (that run asks the node's next slot); once it died (``OwnerDiedError`` on the token) the worker stops the
dead run's pipeline at its next safe point, its temp files deleted, before it serves anyone, and a watchdog in the
worker does so on its own within about a second and a half of the driver's death
(:class:`~resumerge.engine.cluster.keeper.Keeper`). A kept worker idle for ``--keep-workers`` ends itself, which
frees its name.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from resumerge.engine.cluster.actor import NodeActor
from resumerge.engine.cluster.keeper import code_digest
from resumerge.engine.cluster.launch import AHEAD, Worker, declared, end, layout
from resumerge.torch_import import IMPORT_RESERVE

# The namespace of every kept worker's name.
NAMESPACE = "resumerge"
# How long a run waits for a kept worker's answer to its lease (a new one answers once it has imported torch).
LEASE_SECONDS = 60.0
# The slots past a node's own that a run tries when live runs hold those (each its own kept worker).
SPARE_SLOTS = 2


def kept_name(code: str, node_id: str, slot: int) -> str:
    """The name of the kept worker of ``slot`` on the node ``node_id`` that runs the code of digest ``code``."""
    return f"worker-{code}-{node_id[:16]}-{slot}"


def lease(ray: ModuleType, nodes: list[dict[str, Any]], wanted: int, keep: float) -> tuple[list[Worker], int]:
    """A kept worker leased on every live node with a CPU, one per share of its CPUs ``wanted`` wide, each made
    (detached, idle for at most ``keep`` seconds once released) where the node has none that this process's code
    runs and no live run holds; and how many of them served a run before. A worker ``wanted`` wide once its run
    reserved its CPUs (:func:`~resumerge.engine.cluster.launch.adopt`); ended (:func:`~resumerge.engine.cluster.
    launch.end`) it is released. On any raise, the leases already taken are released."""
    code = code_digest()
    token = ray.put(code)  # owned by this process: the lease ends with it
    actor_class = ray.remote(NodeActor)
    workers: list[Worker] = []
    reused = 0
    try:
        for node_id, has, width, count in layout(nodes, wanted, gpu=False, lost=set()):
            needed, slot, last = count, 0, count + SPARE_SLOTS
            while needed > 0 and slot < last:
                batch = range(slot, min(slot + needed, last))
                slot = batch.stop
                asked = [(actor_class.options(
                    name=kept_name(code, node_id, s), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                    num_cpus=0, memory=declared(IMPORT_RESERVE, has), max_restarts=0,
                    max_concurrency=AHEAD + 5,  # as a run's worker, and the lease's calls
                    scheduling_strategy=_pinned(node_id)).remote(None, None, keep)) for s in batch]
                for actor, answer in [(actor, actor.lease.remote([token], code, keep)) for actor in asked]:
                    served = _answer(ray, actor, answer, token)
                    if served is not None:
                        workers.append(Worker(actor, node_id[:8], node_id, width, token=token))
                        reused += served > 0
                        needed -= 1
    except BaseException:
        end(ray, workers)
        raise
    return workers, reused


def _answer(ray: ModuleType, actor: Any, answer: Any, token: Any) -> int | None:
    """A kept worker's ``answer`` to a lease: the runs it served before, or None where it refused (a live run holds
    it, or it runs other code, or it ends), died or did not answer in time (then it is told to release a lease it
    may grant later)."""
    try:
        served: int | None = ray.get(answer, timeout=LEASE_SECONDS)
    except ray.exceptions.GetTimeoutError:
        actor.release.remote([token])
        return None
    except ray.exceptions.RayError:
        return None
    return served


def _pinned(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)

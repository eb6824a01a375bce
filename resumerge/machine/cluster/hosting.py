"""A forward pass's actor hosted by a kept worker: the check's, measure's and eval's model actors and evolve's node
scorers computed in the kept worker of their node (:mod:`~resumerge.machine.cluster.kept`) instead of a fresh
process, so a second pass on a cluster that outlives the run computes at once instead of waiting seconds for a
process to import Ray, the engine and torch. One kept process per (node, slot) serves a merge's shards or a pass,
one lease at a time: the same rules, names, lease and idle time (``--keep-workers``).

On the driver, :func:`lease_hosts` leases a kept worker on each node a pass places an actor on (the node's next
slots where live runs hold the first ones, as a merge's run asks them) and reserves on that node, by a placement
group pinned there, the CPUs the actor would have declared and the rest of its memory (an idle kept worker declares
only its imports'), removed when the pass ends; a :class:`Hosted` then stands for the pass's actor: its
:meth:`Hosted.host` makes the pass's object in the worker, and every other method is called as on a Ray actor
(``hosted.layer.remote(...)``). In the worker, :class:`~resumerge.machine.cluster.hostcalls.Hosting` runs the
calls of the lease that holds it in the order the driver sent them (a kept worker runs its calls on threads: a pass's
protocol, ``head`` then ``compare`` on one actor, needs Ray's order of a one-thread actor), refuses those of an ended
lease, and drops the pass's object when the lease ends (released, or its driver dead:
:class:`~resumerge.machine.cluster.keeper.Keeper`), so the next pass starts as a fresh actor would. Where a node's
worker cannot be leased or its reservation does not come up (:func:`lease_hosts` gives None), or where no worker is
kept, the pass's object is hosted by a fresh actor there instead (:func:`fresh_host`): a ``Hosting`` in a process of
its own, so a pass's object is made and called one way whichever hosts it, and ``Hosting`` is the one Ray actor
class of every pass's objects.

The driver's side; the worker's is :mod:`~resumerge.machine.cluster.hostcalls` (which the worker's actor imports:
this module imports the kept workers' leases and the actor itself).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from resumerge.machine.cluster.kept import lease_on
from resumerge.machine.cluster.launch import NODE_LABEL, RESERVE_SECONDS, Worker, declared, end
from resumerge.machine.torch_import import IMPORT_RESERVE

# The lease a fresh host's calls run under: the actor is the pass's alone, and dies with it.
FRESH = "fresh"


class Hosted:
    """A pass's actor hosted by the kept ``worker`` the driver leased, or by a fresh actor of its own
    (:func:`fresh_host`, whose ``worker`` holds no lease: it is killed as the pass ends): called as a Ray actor
    (``.NAME.remote``), each call numbered in the order it is sent."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.lease = worker.token.hex() if worker.token is not None else FRESH
        self.sent = 0
        self.lock = threading.Lock()

    def host(self, factory: Callable[..., Any], *args: Any) -> Any:
        """Make the pass's object in the worker (a reference to the call, which raises nothing: what the making
        raised is raised by the calls after it)."""
        return self.send("host", factory, *args)

    def send(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The worker actor's ``method`` called for this lease with the next call's number (the order the worker
        runs them in)."""
        with self.lock:
            self.sent += 1
            return getattr(self.worker.actor, method).remote(self.lease, self.sent - 1, *args, **kwargs)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)


class _Method:
    """A hosted object's method, as a Ray actor's: ``remote`` sends the call."""

    def __init__(self, hosted: Hosted, name: str) -> None:
        self.hosted, self.name = hosted, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.hosted.send("call", self.name, *args, **kwargs)


def fresh_host(ray: ModuleType, node_id: str, cpus: float, memory: int) -> Hosted:
    """A fresh actor hosting a pass's object on node ``node_id`` (the kept workers' own
    :class:`~resumerge.machine.cluster.hostcalls.Hosting`, so that a pass's object runs the same calls in the
    same order whichever hosts it), declaring ``cpus`` and ``memory`` (bytes; 0: none), pinned there as a merge's
    Ray workers are (:func:`~resumerge.machine.cluster.launch.pinned`), never restarted by Ray (the pass
    replaces or stops it); ended by :func:`end_hosts` (killed)."""
    from resumerge.machine.cluster.hostcalls import Hosting
    from resumerge.machine.cluster.launch import pinned

    declares: dict[str, Any] = {"memory": memory} if memory > 0 else {}
    actor = ray.remote(Hosting).options(num_cpus=cpus, max_restarts=0, scheduling_strategy=pinned(node_id),
                                        **declares).remote()
    actor.begin.remote(FRESH)  # a one-thread actor: run before the calls sent after it
    return Hosted(Worker(actor, node_id[:8], node_id, 0))


def lease_hosts(ray: ModuleType, wants: Sequence[tuple[str, float, int]], keep: float,
                stream: str) -> list[Hosted | None]:
    """A kept worker for each actor a pass ``wants`` as (node id, CPUs, memory), kept ``keep`` seconds idle once
    released (one made for the lease makes the stream it serves a merge's run with of the class named ``stream``), its
    CPUs and the memory beyond its imports reserved on its node; None where none could be leased or reserved (the pass
    starts a fresh actor there). End them with :func:`end_hosts`."""
    nodes = ray.nodes()
    has = {node["NodeID"]: node.get("Resources", {}) for node in nodes}
    leased, _, _ = lease_on(ray, nodes, Counter(node_id for node_id, _, _ in wants), keep, stream)
    free: dict[str, list[Worker]] = {}
    for worker in leased:
        free.setdefault(worker.node_id, []).append(worker)
    found: list[Hosted | None] = [Hosted(free[node_id].pop()) if free.get(node_id) else None
                                  for node_id, _, _ in wants]
    try:
        _reserve(ray, [(h, cpus, memory - declared(IMPORT_RESERVE, has.get(node_id, {})))
                       for h, (node_id, cpus, memory) in zip(found, wants) if h is not None])
    except BaseException:
        end_hosts(ray, found, kill=True)
        raise
    return found


def _reserve(ray: ModuleType, asks: list[tuple[Hosted, float, int]]) -> None:
    """Reserve each hosted actor's CPUs and memory on its worker's node; where they did not all come up within
    :data:`~resumerge.machine.cluster.launch.RESERVE_SECONDS`, raise: the caller ends the workers."""
    from ray.util.placement_group import placement_group

    for hosted, cpus, memory in asks:
        bundle = {"CPU": cpus} if cpus > 0 else {}
        if memory > 0:
            bundle["memory"] = memory
        if bundle:
            hosted.worker.reserved = placement_group([bundle], strategy="STRICT_PACK",
                                                     bundle_label_selector=[{NODE_LABEL: hosted.worker.node_id}])
    waits = [h.worker.reserved.ready() for h, _, _ in asks if h.worker.reserved is not None]
    if waits and len(ray.wait(waits, num_returns=len(waits), timeout=RESERVE_SECONDS)[0]) < len(waits):
        raise TimeoutError("the kept workers' reservations did not come up")


def end_hosts(ray: ModuleType, hosts: Sequence[Hosted | None], *, kill: bool = False) -> None:
    """Release the kept workers of ``hosts`` (their pass objects dropped, idle for the next run or pass), or kill
    them where ``kill``, and remove their reservations."""
    end(ray, [h.worker for h in hosts if h is not None], kill=kill)

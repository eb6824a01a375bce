"""The Ray actor of a node's worker: a class that imports nothing of the engine, so that the driver can place it
as soon as it has joined the cluster.

Ray places an actor by its class, which the driver must import first. The worker's own class (the merge's
:class:`~resumerge.merge.engine.cluster.worker.ShardStream`) brings the engine with it: a second of the driver's CPU
that a warm start (:mod:`~resumerge.merge.engine.cluster.warm`) would spend, beside the planning thread and its GIL,
before it asked for the workers. :class:`NodeActor` is that class's stand-in on the driver: the driver hands it the
stream's class by name (``"module:Class"``, :data:`~resumerge.merge.engine.cluster.STREAM`), which the actor's
process imports in its constructor (the engine and torch with it), and every call goes to the node's stream.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from resumerge.machine.cluster.keeper import Keeper


class Stream(Protocol):
    """What a node's worker computes with (the merge's shard stream), as the actor calls it: made with what every
    shard shares (``shared``, ``setup``; None: given by :meth:`begin`), each shard computed into ``folder`` and its
    result returned, stopped at its next safe point."""

    def begin(self, shared: Any, setup: Any) -> None: ...

    def compute(self, shard: str, folder: str) -> Any: ...

    def stop(self) -> None: ...


def stream_class(name: str) -> Callable[[Any, Any], Stream]:
    """The stream class ``name`` names (``"module:Class"``), imported in this process."""
    module, _, attribute = name.partition(":")
    made: Callable[[Any, Any], Stream] = getattr(importlib.import_module(module), attribute)
    return made


class NodeActor:
    """A node's worker as Ray runs it: the stream of class ``stream`` (its name, :func:`stream_class`) made in the
    actor's process with ``shared`` and ``setup`` (both None: a warm worker, given them by :meth:`begin`); with ``keep``
    seconds, a kept worker (:mod:`~resumerge.machine.cluster.kept`) named with the digest ``named`` (it ends at
    once where its own differs), whose every lease gets a fresh stream; a kept worker hosts a forward pass's actor too
    (:mod:`~resumerge.machine.cluster.hosting`: :meth:`host`, :meth:`call`), one lease at a time."""

    def __init__(self, shared: Any, setup: Any, keep: float = 0.0, named: str = "", *, stream: str) -> None:
        self.streams = stream  # the stream's class, by name: a renewal makes a fresh one
        self.keeper: Keeper | None = None
        self.used = False  # whether a call used the stream or hosted a pass since the last renewal (see _renew)
        if keep > 0:
            from resumerge.machine.cluster.hostcalls import Hosting
            from resumerge.machine.cluster.keeper import Keeper

            self.hosting = Hosting()
            self.keeper = Keeper(keep, self._renew, named)
            if self.keeper.other:  # it only answers the lease that made it, then ends: no engine, no torch (seconds)
                return
        self.stream = stream_class(stream)(shared, setup)

    def begin(self, shared: Any, setup: Any) -> None:
        """The stream's ``begin`` (:class:`Stream`)."""
        self.used = True
        self.stream.begin(shared, setup)

    def compute(self, shard: str, folder: str) -> Any:
        """The stream's ``compute`` (:class:`Stream`)."""
        self.used = True
        return self.stream.compute(shard, folder)

    def stop(self) -> None:
        """The stream's ``stop`` (:class:`Stream`)."""
        self.used = True  # (a stopped stream serves no later begin: renewed)
        self.stream.stop()

    def lease(self, box: list[Any], code: str, keep: float) -> int | None:
        """See :meth:`~resumerge.machine.cluster.keeper.Keeper.lease` (None from a worker that is not kept)."""
        if self.keeper is None:
            return None
        served = self.keeper.lease(box, code, keep)
        if served is not None and served >= 0:  # (OTHER_CODE is negative)
            self.hosting.begin(box[0].hex())
        return served

    def host(self, lease: str, seq: int, factory: Callable[..., Any], *args: Any) -> None:
        """See :meth:`~resumerge.machine.cluster.hostcalls.Hosting.host`."""
        self.used = True
        self.hosting.host(lease, seq, factory, *args)

    def call(self, lease: str, seq: int, name: str, *args: Any, **kwargs: Any) -> Any:
        """See :meth:`~resumerge.machine.cluster.hostcalls.Hosting.call`."""
        self.used = True
        return self.hosting.call(lease, seq, name, *args, **kwargs)

    def release(self, box: list[Any]) -> None:
        """See :meth:`~resumerge.machine.cluster.keeper.Keeper.release`."""
        if self.keeper is not None:
            self.keeper.release(box)

    def _renew(self) -> None:
        """The stream stopped (its pipeline at its next safe point, its temp files deleted) and a fresh one made, a
        hosted pass's object dropped: the next :meth:`begin` sets torch's intra-op threads again (a pass's object as
        it is made) and each upload puts its process-wide Xet switch back; what a run leaves in the process beyond
        (torch's inter-op thread count, set once per process; the modules it imported) does not change the bytes
        the next run or pass makes.
        The heap the run freed goes back to the system: idle, the worker holds about what its imports take (the
        memory it declares), not its last run's peak. A lease that made no call (a released worker leased again, a
        run refused before it computed) left nothing to stop or free: only its hosted calls' turn ends (a full
        collection of a process holding torch costs ~0.1 CPU s, twice a lease)."""
        import gc

        from resumerge.machine.memory.allocator import malloc_trim

        self.hosting.end()  # a pass's object, hosted for the lease, dropped
        if not self.used:
            return
        self.used = False  # (before the stop: a dead lease's call that comes meanwhile marks it used again)
        self.stream.stop()
        self.stream = stream_class(self.streams)(None, None)
        gc.collect()
        trim = malloc_trim()
        if trim is not None:
            trim(0)

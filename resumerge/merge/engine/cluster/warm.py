"""A Ray run's workers started while it plans: the cluster joined and a worker per node started in the background
from the API call's first step, so that the workers' imports (a fresh process importing the engine and torch,
seconds) overlap the driver's own imports and planning instead of following them.

The API call that runs or resumes a merge owns one :class:`WarmStart` for its run (on its executor:
:attr:`~resumerge.merge.engine.executors.RayExecutor.early`) and closes it when the call ends, which ends every worker
the run did not take, whatever ended the call; the Ray executor takes the workers (:meth:`WarmStart.take`) once it
knows the plan, and from then on ends them itself (:mod:`~resumerge.machine.cluster.launch` adopts or ends them).
Nothing is started where the API call names no cluster and the process is not connected to one (a Ray started for
the run is left to the executor's own join), and a start that fails only loses the head start: the executor's own
join and start then say what is wrong. Such a cluster outlives the run: unless ``--keep-workers 0``, the start
leases the kept workers the runs before left on it (:mod:`~resumerge.machine.cluster.kept`), which have imported
everything already, and "ending" them releases them for the next run.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from resumerge.machine import rayconnect as connect

# The workers' launch (which brings nothing of the engine: the workers' processes import it) is imported here, by
# the API call's thread, and Ray by the start's own thread: that thread imports no module of resumerge while the
# call imports the planner beside it. Two threads importing one package tree at once can fail (CPython raises
# _DeadlockError in the thread that imports a submodule of a package the other is initialising, or hands it the
# half-made package), and the packages that the call has not loaded yet (methods, moe, vocab, inputs' codecs,
# adapters and hub) import their modules eagerly. tests/test_warm_start.py pins that the thread imports none.
from resumerge.machine.cluster import kept, launch
from resumerge.machine.torch_import import IMPORT_RESERVE
from resumerge.merge.engine.cluster import STREAM

if TYPE_CHECKING:
    from resumerge.machine.cluster.launch import Worker


class WarmStart:
    """Joining the cluster at ``where`` (None: the one this process is connected to) and starting a warm worker of
    ``threads`` threads per share of every node's CPUs, in a thread of its own started at once: with ``keep``
    seconds, leasing the node's kept workers (made where none is free: :mod:`~resumerge.machine.cluster.kept`),
    else starting workers that end with the run."""

    def __init__(self, where: str | None, threads: int | None, keep: float = 0.0) -> None:
        self.where, self.threads, self.keep = where, threads, keep
        self.ray: ModuleType | None = None
        self.workers: list[Worker] = []  # started and not taken yet
        self.held: list[Worker] = []  # kept workers a run took and handed back, still leased (:meth:`hold`)
        self.reused = 0  # of them, the kept workers that served a run before
        self.other = 0  # the kept workers that refused the lease: they run other code or another runtime_env
        # Set once the call ends (close): what the start places from then on is its own to end. Set, and read with
        # what was placed, under the lock, so that every worker is ended by exactly one of the two threads.
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._start, name="resumerge-ray-warm-start", daemon=True)
        self.thread.start()

    @classmethod
    def of(cls, address: str | None, threads: int | None, keep: float) -> WarmStart | None:
        """The warm start of a run on the cluster at ``address`` with torch's ``threads`` and workers kept ``keep``
        seconds (None where there is nothing to join: no address, no ``RAY_ADDRESS`` and no connection of this
        process)."""
        ray = sys.modules.get("ray")
        connected = ray is not None and ray.is_initialized()
        where = address or os.environ.get("RAY_ADDRESS") or None
        if not connected and where is None:
            return None
        return cls(None if connected else where, threads, keep)

    def joined(self) -> None:
        """Wait until the cluster is joined (or failed to be) and the workers' start is asked for."""
        self.thread.join()

    def take(self, should_stop: Callable[[], bool] = lambda: False, every: float = 0.25) -> list[Worker]:
        """The workers started (none if the start failed or the run was stopped meanwhile); the caller's to end from
        now on. The start is waited for in steps of ``every`` seconds, ``should_stop`` asked between them: a stopped
        run takes nothing and the start ends what it places once the call closes (:meth:`close`). A recipe's later
        stage leases again the kept workers the stages before handed back (:meth:`hold`): released, each makes a
        fresh stream, and the lease finds the same processes by their names (those another run took meanwhile
        replaced by the next slots')."""
        while self.thread.is_alive():  # the start is under way: a Ctrl-C meanwhile stops the run at once
            if should_stop():
                return []
            self.thread.join(every)
        with self._lock:
            workers, self.workers = self.workers, []
            held, self.held = self.held, []
        if held and self.ray is not None:
            self._release(held)  # released: the lease below is refused while this run's token holds them
            try:
                workers, self.reused, self.other = kept.lease(self.ray, self.ray.nodes(),
                                                              launch.default_threads(self.threads), self.keep, STREAM)
            except Exception:  # only the head start is lost: the executor places its own
                return []
        return workers

    def hold(self, workers: list[Worker]) -> None:
        """Keep a run's kept ``workers`` (stopped, their reservations removed) leased until the call ends, which
        releases them for the next run (:meth:`close`)."""
        with self._lock:
            if not self.closed.is_set():
                self.held += workers
                return
        self._release(workers)

    def close(self) -> None:
        """End the workers the run did not take (it was refused, failed or ended before it took them) and release
        the kept ones it handed back (:meth:`hold`), without waiting for a start still under way (a run that failed
        fast would wait for the join and the placement, and a second Ctrl-C meanwhile would leave the workers
        running): that start ends what it places itself."""
        with self._lock:
            self.closed.set()
            workers, self.workers, self.held = self.workers + self.held, [], []
        self._release(workers)

    def _release(self, workers: list[Worker]) -> None:
        """End ``workers`` (release the kept ones); killed when that is interrupted (a second Ctrl-C while they
        release): none stays leased by this process."""
        if not workers or self.ray is None:
            return
        try:
            launch.end(self.ray, workers)
        except BaseException:
            launch.end(self.ray, workers, kill=True)
            raise

    def _start(self) -> None:
        try:
            ray = connect.require_ray()
            if self.where is not None:
                connect.join(self.where)
            if self.closed.is_set():
                return
            threads = launch.default_threads(self.threads)
            if self.keep > 0:
                workers, reused, other = kept.lease(ray, ray.nodes(), threads, self.keep, STREAM)
            else:
                workers, reused, other = launch.place(ray, ray.nodes(), None, None, threads, IMPORT_RESERVE,
                                                      gpu=False, lost=set(), stream=STREAM), 0, 0
            with self._lock:
                closed = self.closed.is_set()
                if not closed:
                    self.ray, self.workers, self.reused, self.other = ray, workers, reused, other
            if closed:  # the call ended while they were placed: nobody else will end them
                launch.end(ray, workers)
        except Exception:  # (an import failed included) only the head start is lost: the executor's own join and
            return  # start say what is wrong, and place ended what it had made before it raised

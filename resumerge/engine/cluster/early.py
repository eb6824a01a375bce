"""A Ray run's cluster joined and its workers started in the background, while the run imports and plans.

Joining a running cluster takes about a second and a worker's start (a fresh process importing the engine and
torch) a few more: the longest waits of a short Ray run. So the CLI, right after parsing its arguments, and the API,
as a run begins, call :func:`join_soon`: a thread joins the cluster and starts the run's workers warm there
(:func:`~resumerge.engine.cluster.launch.warm_workers`), then waits. The run's executor takes them with
:func:`claim` once it has planned (and joins, at once: the thread has); the API's call ends with :func:`let_go`,
which ends the workers no run took. The thread is found by its class among the running threads: no module state.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any

from resumerge.engine.cluster.connect import join

# The name of the early join's thread.
JOINING = "resumerge-ray-join"


def join_soon(address: str | None, threads: int | None) -> None:
    """Start joining the running cluster at ``address`` (None: ``RAY_ADDRESS``) in a background thread, then start
    warm workers of ``threads`` threads (None: the default) there
    (:func:`~resumerge.engine.cluster.launch.warm_workers`): the run takes them with :func:`claim`, and
    :func:`let_go` ends those it did not take. A process connected already (a notebook, a test) only starts the
    warm workers. Nothing when this process is joining already, or when neither names a cluster (starting a local
    Ray is left to the run's own join: a run refused meanwhile would leave it half started). A join that fails here
    is made again by the run's own, which raises its error."""
    where = address or os.environ.get("RAY_ADDRESS") or None
    imported = sys.modules.get("ray")
    connected = imported is not None and imported.is_initialized()
    if _joining() is not None or (where is None and not connected):
        return
    _Joining(None if connected else where, threads).start()


def claim() -> list[Any]:
    """The workers the early join started (none without one); they are the caller's to end from now on."""
    joining = _joining()
    if joining is None:
        return []
    joining.joined.wait()
    workers, joining.workers = joining.workers, []
    joining.settled.set()
    return workers


def let_go() -> None:
    """End the early join's workers that no run claimed (the run was refused, or ended, before it took them)."""
    joining = _joining()
    if joining is not None:
        joining.joined.wait()
        joining.settled.set()
        joining.join()


class _Joining(threading.Thread):
    """The early join of :func:`join_soon`: connects (off the main thread, ``ray.init`` leaves the signal handlers
    alone), starts the warm workers, then waits until they are claimed or let go, ending them in the latter case."""

    def __init__(self, where: str | None, threads: int | None) -> None:
        super().__init__(name=JOINING, daemon=True)
        self.where, self.threads = where, threads
        self.ray: ModuleType | None = None
        self.workers: list[Any] = []
        self.joined = threading.Event()  # connected (or failed to) and the warm workers started
        self.settled = threading.Event()  # claimed or let go

    def run(self) -> None:
        # The engine's modules, imported here, beside what the main thread does meanwhile.
        from resumerge.engine.cluster.launch import end, warm_workers

        try:
            self.ray = ray = join(self.where)  # off the main thread, ray.init leaves the signal handlers alone
            self.workers = warm_workers(ray, self.threads)
        except Exception:  # workers started early only save time: the run's own start says what fails
            self.workers = []
        finally:
            self.joined.set()
        self.settled.wait()
        if self.ray is not None:
            end(self.ray, self.workers)  # none once claimed


def _joining() -> _Joining | None:
    """The early join's thread while it runs (a process holds no state of ours for it)."""
    return next((t for t in threading.enumerate() if isinstance(t, _Joining)), None)



"""Ray, found and joined: the one place that imports it, so that a run without ``--executor ray`` never needs it.

A cluster is joined at ``--ray-address`` (a ``ray://`` client address or a head's ``HOST:PORT``), else at
``RAY_ADDRESS`` when set, else a Ray is started for the run on this machine; a process already connected (a
notebook, a test's cluster) keeps its connection. Joining a running cluster takes about a second and a worker's
start a few more, so a run starts both in the background (:func:`join_soon`: the CLI right after parsing its
arguments, the API as a run begins) and imports and plans meanwhile; :func:`join` then waits for that join instead
of making its own, :func:`claim` takes its warm workers and :func:`let_go` ends those no run took.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from resumerge.errors import UnreachableError, UsageError

INSTALL_HINT = "pip install 'resumerge[ray]'"
# The name of the thread of :func:`join_soon`.
JOINING = "resumerge-ray-join"


def require_ray() -> ModuleType:
    """The ``ray`` module; raises :class:`UsageError` (exit 2) naming how to install it when it is missing."""
    try:
        ray = importlib.import_module("ray")
    except ImportError:
        raise UsageError("--executor ray needs Ray, which is not installed", hint=f"install it: {INSTALL_HINT}") \
            from None
    return ray


def join(address: str | None) -> ModuleType:
    """Connect this process to the cluster at ``address`` (None: ``RAY_ADDRESS``, else a local Ray started now)
    unless it is connected already (or being connected by :func:`join_soon`: this waits for it); returns the
    ``ray`` module. Raises :class:`UsageError` without Ray and :class:`UnreachableError` (exit 3) when the cluster
    cannot be joined."""
    ray = require_ray()
    joining = _joining()
    if joining is not None:
        joining.joined.wait()
    if ray.is_initialized():
        return ray
    where = address or os.environ.get("RAY_ADDRESS") or None
    try:
        with _signals_kept():
            _init(ray, where)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        raise UnreachableError(f"cannot join the Ray cluster at {where}: {exc}",
                               hint="check --ray-address (or RAY_ADDRESS) and that the head node runs") from None
    return ray


def join_soon(address: str | None, threads: int | None) -> None:
    """Start joining the running cluster at ``address`` (None: ``RAY_ADDRESS``) in a background thread, for
    :func:`join` to find, then start warm workers of ``threads`` threads (None: the default) there
    (:func:`~resumerge.engine.cluster.launch.warm_workers`): the run takes them with :func:`claim`, and
    :func:`let_go` ends those it did not take. A process connected already (a notebook, a test) only starts the
    warm workers. Nothing when this process is joining already, or when neither names a cluster (starting a local
    Ray is left to :func:`join`: a run refused meanwhile would leave it half started). A join that fails here is
    made again by :func:`join`, which raises its error."""
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
            self.ray = ray = require_ray()
            if self.where is not None:  # None: connected already
                with contextlib.suppress(ConnectionError, RuntimeError, TimeoutError):
                    _init(ray, self.where)
            if ray.is_initialized():
                self.workers = warm_workers(ray, self.threads)
        except Exception:  # workers started early only save time: the run's own start says what fails
            self.workers = []
        finally:
            self.joined.set()
        self.settled.wait()
        if self.ray is not None:
            end(self.ray, self.workers)  # none once claimed


def _joining() -> _Joining | None:
    """The early join's thread while it runs (found by name: a process holds no state of ours for it)."""
    return next((t for t in threading.enumerate() if isinstance(t, _Joining)), None)


def _init(ray: ModuleType, where: str | None) -> None:
    # Workers' logs stay on their nodes: the driver's display is the run's progress, not their chatter.
    ray.init(address=where, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             configure_logging=True)


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """``ray.init`` routes SIGTERM to ``sys.exit`` (and starting a local Ray, to a shutdown of its processes): the
    CLI's handlers, which stop the run at its next safe point with the resume command, are put back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(s, handler)


def this_node() -> str:
    """The Ray node this process runs on, as the ledger's ``node`` events name it (a worker's view)."""
    return str(require_ray().get_runtime_context().get_node_id())[:8]

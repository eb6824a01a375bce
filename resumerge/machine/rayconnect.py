"""Ray, found and joined: the one place that imports it, so that a run without ``--executor ray`` never needs it.

A cluster is joined at ``--ray-address`` (a ``ray://`` client address or a head's ``HOST:PORT``), else at
``RAY_ADDRESS`` when set, else a Ray is started for the run on this machine; a process already connected (a
notebook, a test's cluster) keeps its connection.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import ModuleType

from resumerge.errors import UnreachableError, UsageError

# No package index has resumerge: the clone's extra, as the README says (``resumerge[ray]`` cannot be found).
INSTALL_HINT = "pip install -c constraints.txt -e '.[ray]' in the resumerge clone, on every node"


def require_ray() -> ModuleType:
    """The ``ray`` module; raises :class:`UsageError` (exit 2) naming how to install it when it is missing."""
    try:
        ray = importlib.import_module("ray")
    except ImportError:
        raise _missing() from None
    return ray


def check_ray() -> None:
    """Raise :class:`UsageError` (exit 2) naming how to install Ray when it is missing, without importing it (a
    second of CPU, which a run spends in the background while it plans: :mod:`~resumerge.merge.engine.cluster.warm`)."""
    if "ray" in sys.modules:
        if sys.modules["ray"] is None:  # marked missing (as where it is not installed)
            raise _missing()
        return
    if importlib.util.find_spec("ray") is None:
        raise _missing()


def _missing() -> UsageError:
    return UsageError("--executor ray needs Ray, which is not installed", hint=f"install it: {INSTALL_HINT}")


def join(address: str | None) -> ModuleType:
    """Connect this process to the cluster at ``address`` (None: ``RAY_ADDRESS``, else a local Ray started now)
    unless it is connected already; returns the ``ray`` module. Raises :class:`UsageError` without Ray and
    :class:`UnreachableError` (exit 3) when the cluster cannot be joined."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    where = address or os.environ.get("RAY_ADDRESS") or None
    # Off the main thread (a run's warm start) Ray warns that it cannot set its SIGTERM handler: the CLI's handlers
    # are the ones that count anyway (see _signals_kept).
    level = "WARNING" if threading.current_thread() is threading.main_thread() else "ERROR"
    try:
        with _signals_kept():
            # Workers' logs stay on their nodes: the driver's display is the run's progress, not their chatter.
            ray.init(address=where, include_dashboard=False, log_to_driver=False, logging_level=level,
                     configure_logging=True)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        raise UnreachableError(f"cannot join the Ray cluster at {where}: {exc}",
                               hint="check --ray-address (or RAY_ADDRESS) and that the head node runs") from None
    return ray


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
    """The Ray node this process runs on, as the ledger's ``node`` events name it (a worker's view). Asked in a
    process Ray does not run, it raises: Ray's runtime context would start a local cluster to answer, and leave this
    process its driver (whose error listener then writes the raylet's complaints to stderr, ``--quiet`` or not)."""
    ray = require_ray()
    if not ray.is_initialized():
        raise RuntimeError("this_node() asked in a process that is not on Ray")
    return str(ray.get_runtime_context().get_node_id())[:8]

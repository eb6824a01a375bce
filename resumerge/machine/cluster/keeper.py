"""A kept worker's side of its leases (:mod:`~resumerge.machine.cluster.kept`): who holds it, whether that run's
driver still lives, and when the worker ends itself.

Runs in the worker's process. A lease is the driver's token (an object the driver put, so owned by it): the
worker holds its reference and reads it; the read raises ``OwnerDiedError`` once the driver died (``ray.wait``
still says ready then: only the read tells). A lease whose holder died is taken back by the next lease asked, or
by the watchdog thread (every :data:`WATCH_SECONDS`; the delay: :mod:`~resumerge.machine.cluster.kept`): either
first stops the dead run's pipeline at its next safe point (the shard it was writing abandoned, its temp file deleted)
and makes a fresh stream, so the next run computes as a fresh worker would. A worker no run holds for ``keep``
seconds refuses every lease from then on and ends its actor, which frees its name; so does, at once, a worker whose
stream did not stop within :data:`RENEW_SECONDS` (or failed to), and, once it answered the lease that made it
(:data:`TELL_SECONDS`), one whose own code is not its name's.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resumerge.config.version import __version__
from resumerge.machine.rayconnect import require_ray

# How often the watchdog reads the lease's token (and looks at the idle time).
WATCH_SECONDS = 0.25
# How long a read of the token may wait before the holder counts as alive (a read of a live driver's is instant).
READ_SECONDS = 2.0
# How long the worker waits for Ray to end its actor before it ends its process itself.
END_SECONDS = 5.0
# How long a lease or release waits for the stream to stop (a hub upload's safe point can be minutes away) before
# the worker ends itself instead.
RENEW_SECONDS = 8.0
# A lease's answer where the worker runs other code or another runtime_env than the run (its digest differs: the run
# says so, each of its runs then starting its own workers).
OTHER_CODE = -1
# How long a worker whose own code is not its name's waits for the lease that made it before it ends: answered
# OTHER_CODE, that run asks the node no further slot (resumerge.machine.cluster.kept); ended first, it would answer
# nothing, and the run would make a worker at the node's next slot, which would run the node's code too.
TELL_SECONDS = 5.0


def code_digest() -> str:
    """A digest of the code a worker runs, equal on every node that runs the same code whatever its checkout's path
    or file times: resumerge's version and its package files' relative paths and contents, Python's version, and
    every installed distribution's name and version (:func:`installed`). The package is the folder above this
    file that holds ``__main__.py``, however deep the layout files this module."""
    root = next(p for p in Path(__file__).resolve().parents if (p / "__main__.py").is_file())  # resumerge/
    python = f"{sys.implementation.name} {platform.python_version()}"
    digest = hashlib.sha256(f"{__version__}\0{python}\n".encode())
    for name in sorted(installed()):
        digest.update(f"{name}\n".encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def installed() -> set[str]:
    """Every distribution installed on ``sys.path`` (the dependencies' own dependencies included) as
    ``name==version``, its name normalised: from its dist-info folder's name, where the wheel format writes both
    (a listing per path: reading every distribution's metadata took 0.3 CPU s on the driver's start, with 170
    installed), else (an egg-info) from its metadata. Nothing is imported."""
    found = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # a zip, or a path that does not exist
            continue
        for folder in names:
            stem, _, kind = folder.rpartition(".")
            if kind not in ("dist-info", "egg-info"):
                continue
            name, _, version = stem.partition("-")
            if not version or kind == "egg-info":  # an egg-info's name may carry no version, or a Python tag
                version = importlib.metadata.PathDistribution(Path(entry or ".", folder)).version
            found.add(f"{re.sub(r'[-_.]+', '_', name).lower()}=={version}")
    return found


def run_digest(ray: Any) -> str:
    """The digest a kept worker's name carries and its leases are checked against: :func:`code_digest` and the
    runtime_env of the job (Ray gives a detached actor its creating job's: env_vars such as HF_TOKEN, working_dir,
    pip), so a worker serves only runs of the same code and the same runtime_env."""
    env = json.dumps(dict(ray.get_runtime_context().runtime_env or {}), sort_keys=True, default=str)
    return hashlib.sha256(f"{code_digest()}\0{env}".encode()).hexdigest()[:16]


class Keeper:
    """The leases of a kept worker idle for at most ``keep`` seconds, named with the :func:`run_digest` ``named``;
    ``renew`` stops its stream and makes a fresh one (called under the keeper's lock, with no run holding the
    worker, for at most :data:`RENEW_SECONDS`). A worker whose own digest is not ``named`` (another node's code
    under the same name) ends once it answered the lease that made it (:data:`OTHER_CODE`; at most
    :data:`TELL_SECONDS`), one whose stream did not stop in time or failed to at once."""

    def __init__(self, keep: float, renew: Callable[[], None], named: str) -> None:
        self.keep, self.renew = keep, renew
        self.code = run_digest(require_ray())  # of the code and runtime_env this process runs
        self.lock = threading.Lock()
        self.holder: Any = None  # the token of the run that holds it
        self.served = 0  # the leases granted so far
        self.idle_since = time.monotonic()
        self.other = self.code != named
        self.ended = self.other  # (the watchdog ends the actor once it said so: _watched)
        self.told = threading.Event()  # a lease was answered OTHER_CODE
        self.born = time.monotonic()
        self.watchdog = threading.Thread(target=self._watch, name="resumerge-kept-watchdog", daemon=True)
        self.watchdog.start()

    def lease(self, box: list[Any], code: str, keep: float) -> int | None:
        """Lease the worker to the run whose token is ``box``'s (a list, so that Ray passes the reference, not its
        value) and whose code has the digest ``code``, to be kept ``keep`` seconds idle after it; returns the leases
        it granted before, :data:`OTHER_CODE` where it runs other code, or None where it refuses otherwise (another
        live run holds it, or it ends)."""
        with self.lock:
            if code != self.code:
                self.told.set()
                return OTHER_CODE
            if self.ended or (self.holder is not None and _alive(self.holder)):
                return None
            if not self._renewed():  # a dead run's pipeline stopped, a fresh stream
                return None
            self.holder, self.keep = box[0], keep
            self.served += 1
            return self.served - 1

    def release(self, box: list[Any]) -> None:
        """The run of ``box``'s token ended: its pipeline stops (if it did not already) and the worker is idle. (A
        run releases only leases it was granted, and asks each lease once: no lease of a released token follows.)"""
        with self.lock:
            if self.holder is not None and self.holder.hex() == box[0].hex():
                self._free()

    def _free(self) -> None:
        self._renewed()
        self.holder, self.idle_since = None, time.monotonic()

    def _renewed(self) -> bool:
        """Whether ``renew`` ended within :data:`RENEW_SECONDS` without raising; if not, the worker ended (it
        refuses every lease, and the watchdog ends its actor, which ends the stuck pipeline with its process)."""
        if self.ended:  # (a stream that did not stop is not waited for twice)
            return False
        failed: list[BaseException] = []

        def renew() -> None:
            try:
                self.renew()
            except BaseException as exc:  # (ended below: a stream that failed to stop is not reused)
                failed.append(exc)

        thread = threading.Thread(target=renew, name="resumerge-kept-renew", daemon=True)
        thread.start()
        thread.join(RENEW_SECONDS)
        if thread.is_alive() or failed:
            self.ended = True
        return not self.ended

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            try:
                if self._watched():
                    _end_actor()
                    return
            except Exception:  # (a read that failed otherwise, a stream that failed to stop) the next turn retries:
                continue  # the watchdog alone ends an idle worker, so it never stops watching

    def _watched(self) -> bool:
        """Take a dead holder's lease back; True once the worker has been idle for its time (it refuses leases from
        then on, and once it ended otherwise)."""
        if self.ended:  # one of other code first answers the lease that made it (TELL_SECONDS)
            return not self.other or self.told.is_set() or time.monotonic() - self.born >= TELL_SECONDS
        holder = self.holder
        if holder is not None:
            if not _alive(holder):
                with self.lock:
                    if self.holder is holder:
                        self._free()
            return False
        with self.lock:
            self.ended = self.ended or (self.holder is None and time.monotonic() - self.idle_since >= self.keep)
        return self.ended


def _alive(holder: Any) -> bool:
    """Whether the driver that put ``holder`` still lives."""
    ray = require_ray()
    try:
        ray.get(holder, timeout=READ_SECONDS)
    except ray.exceptions.ObjectLostError:  # OwnerDiedError among them
        return False
    except ray.exceptions.GetTimeoutError:
        return True
    return True


def _end_actor() -> None:
    """End this actor (its name is freed once Ray ends it), and its process if Ray does not."""
    ray = require_ray()
    try:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
    finally:
        time.sleep(END_SECONDS)
        os._exit(0)

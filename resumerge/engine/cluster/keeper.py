"""A kept worker's side of its leases (:mod:`~resumerge.engine.cluster.kept`): who holds it, whether that run's
driver still lives, and when the worker ends itself.

Runs in the worker's process. A lease is the driver's token (an object the driver put, so owned by it): the
worker holds its reference and reads it; the read raises ``OwnerDiedError`` once the driver died (``ray.wait``
still says ready then: only the read tells). A lease whose holder died is taken back by the next lease asked, or
by the watchdog thread (every :data:`WATCH_SECONDS`, detecting a death in about a second more): either first
stops the dead run's pipeline at its next safe point (the shard it was writing abandoned, its temp file deleted)
and makes a fresh stream, so the next run computes as a fresh worker would. A worker no run holds for ``keep``
seconds refuses every lease from then on and ends its actor, which frees its name.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resumerge.config.version import __version__
from resumerge.engine.cluster.connect import require_ray

# How often the watchdog reads the lease's token (and looks at the idle time).
WATCH_SECONDS = 0.25
# How long a read of the token may wait before the holder counts as alive (a read of a live driver's is instant).
READ_SECONDS = 2.0
# How long the worker waits for Ray to end its actor before it ends its process itself.
END_SECONDS = 5.0


def code_digest() -> str:
    """A digest of the code a worker runs: resumerge's version, its package files' paths, sizes and times, the
    Python executable, and torch's version (read without importing torch)."""
    root = Path(__file__).resolve().parents[2]
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = ""
    digest = hashlib.sha256(f"{__version__}\0{sys.executable}\0{torch_version}\0{root}\n".encode())
    for path in sorted(root.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


class Keeper:
    """The leases of a kept worker idle for at most ``keep`` seconds; ``renew`` stops its stream and makes a fresh
    one (called under the keeper's lock, with no run holding the worker)."""

    def __init__(self, keep: float, renew: Callable[[], None]) -> None:
        self.keep, self.renew = keep, renew
        self.code = code_digest()  # of the code this process runs
        self.lock = threading.Lock()
        self.holder: Any = None  # the token of the run that holds it
        self.served = 0  # the leases granted so far
        self.idle_since = time.monotonic()
        self.ended = False
        self.watchdog = threading.Thread(target=self._watch, name="resumerge-kept-watchdog", daemon=True)
        self.watchdog.start()

    def lease(self, box: list[Any], code: str, keep: float) -> int | None:
        """Lease the worker to the run whose token is ``box``'s (a list, so that Ray passes the reference, not its
        value) and whose code has the digest ``code``, to be kept ``keep`` seconds idle after it; returns the leases
        it granted before, or None where it refuses (another live run holds it, it runs other code, or it ends)."""
        with self.lock:
            if self.ended or code != self.code or (self.holder is not None and _alive(self.holder)):
                return None
            self.renew()  # a dead run's pipeline stopped, a fresh stream
            self.holder, self.keep = box[0], keep
            self.served += 1
            return self.served - 1

    def release(self, box: list[Any]) -> None:
        """The run of ``box``'s token ended: its pipeline stops (if it did not already) and the worker is idle."""
        with self.lock:
            if self.holder is not None and self.holder.hex() == box[0].hex():
                self._free()

    def leased(self) -> bool:
        """Whether a run holds the worker (a dead one's lease counts until taken back)."""
        return self.holder is not None

    def _free(self) -> None:
        self.renew()
        self.holder, self.idle_since = None, time.monotonic()

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
        then on)."""
        holder = self.holder
        if holder is not None:
            if not _alive(holder):
                with self.lock:
                    if self.holder is holder:
                        self._free()
            return False
        with self.lock:
            self.ended = self.holder is None and time.monotonic() - self.idle_since >= self.keep
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

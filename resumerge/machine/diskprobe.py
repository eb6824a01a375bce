"""Disks as a merge sees them: free space, which paths share a filesystem, and a quick read/write speed probe.

The speed probe writes a small file of resumerge's own temp name (``.resumerge-probe-<hex>.part``) into the
directory it measures, fsyncs it, drops it from the page cache and reads it back; the file is deleted whatever
happens. A figure is a rough guide (one sequential stream of 32 MiB by default), good enough to tell a local SSD
from a network mount. Nothing here raises for an unusable directory: the figure is ``None`` with a note.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "PROBE_PREFIX",
    "DiskFree",
    "DiskSpeed",
    "device_of",
    "free_bytes",
    "nearest_existing",
    "probe_directory",
    "probe_file_read",
]

DEFAULT_PROBE_BYTES = 32 * 2**20
PROBE_PREFIX = ".resumerge-probe-"
_BLOCK = 4 * 2**20

# How a caller reads free space; tests inject a fake to simulate a small disk.
DiskFree = Callable[[Path], int]


@dataclass(frozen=True)
class DiskSpeed:
    """Sequential throughput measured in ``path``, in bytes per second (``None`` when not measured, see ``note``)."""

    path: str
    write_bytes_per_s: float | None
    read_bytes_per_s: float | None
    probe_bytes: int
    note: str | None = None


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute, or its closest ancestor that exists (where a new directory would be created)."""
    current = Path(os.path.abspath(path))
    while not current.exists() and current != current.parent:
        current = current.parent
    return current


def unwritable(path: str | os.PathLike[str], what: str, fix: str = "use another --state-dir") -> str | None:
    """Why a directory could not be created or written at ``path`` (``what`` names it in the sentence, ``fix``
    says what to do), or None when its nearest existing ancestor is a directory this process may write in."""
    nearest = nearest_existing(path)
    if not nearest.is_dir():
        return f"{what} {path} cannot be created: {nearest} is not a directory; {fix}"
    if not os.access(nearest, os.W_OK | os.X_OK):
        return f"{what} {path} is not writable ({nearest} is read-only here); {fix}"
    return None


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding ``path`` (or its nearest ancestor)."""
    return shutil.disk_usage(nearest_existing(path)).free


def device_of(path: str | os.PathLike[str]) -> int:
    """The filesystem id (``st_dev``) of ``path``'s nearest existing ancestor: equal ids share free space."""
    return nearest_existing(path).stat().st_dev


def probe_directory(directory: str | os.PathLike[str], nbytes: int = DEFAULT_PROBE_BYTES,
                    *, disk_free: DiskFree = free_bytes) -> DiskSpeed:
    """Measure write+fsync and cold read speed in ``directory`` (its nearest existing ancestor if missing).

    Writes ``nbytes`` to a new temp file there and always deletes it. Skipped (figures ``None``) when ``nbytes`` is
    0, when the disk has less than twice ``nbytes`` free (a probe must never be what fills a disk), or when the
    directory is not writable.
    """
    where = nearest_existing(directory)
    if nbytes <= 0:
        return DiskSpeed(str(where), None, None, 0, "speed probe disabled")
    if disk_free(where) < 2 * nbytes:
        return DiskSpeed(str(where), None, None, 0, "too little free space to probe the speed")
    path = where / f"{PROBE_PREFIX}{secrets.token_hex(6)}.part"
    block = os.urandom(min(_BLOCK, nbytes))  # incompressible, so a compressing filesystem cannot flatter itself
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        return DiskSpeed(str(where), None, None, 0, f"cannot write there ({exc.strerror or exc})")
    try:
        started = time.perf_counter()
        try:
            written = 0
            while written < nbytes:
                written += os.write(fd, block[: nbytes - written])
            os.fsync(fd)
            write_seconds = time.perf_counter() - started
            _drop_cache(fd, 0, nbytes)
        finally:
            os.close(fd)
        read_speed = _timed_read(path, 0, nbytes)
        return DiskSpeed(str(where), nbytes / max(write_seconds, 1e-6), read_speed, nbytes)
    except OSError as exc:
        return DiskSpeed(str(where), None, None, 0, f"probe failed ({exc.strerror or exc})")
    finally:
        path.unlink(missing_ok=True)


def probe_file_read(path: str | os.PathLike[str], nbytes: int = DEFAULT_PROBE_BYTES) -> float | None:
    """Cold sequential read speed of an existing file (bytes/s), from up to ``nbytes`` in its middle.

    The sampled range is dropped from the page cache first, so the figure is the device's, not RAM's; ``None``
    when the file cannot be read or ``nbytes`` is 0.
    """
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    length = min(nbytes, size)
    if length <= 0:
        return None
    start = (size - length) // 2
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            _drop_cache(fd, start, length)
        finally:
            os.close(fd)
        return _timed_read(Path(path), start, length)
    except OSError:
        return None


def _timed_read(path: Path, start: int, length: int) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        done = 0
        while done < length:
            chunk = os.pread(fd, min(_BLOCK, length - done), start + done)
            if not chunk:
                break
            done += len(chunk)
        return done / max(time.perf_counter() - started, 1e-6)
    finally:
        os.close(fd)


def _drop_cache(fd: int, start: int, length: int) -> None:
    # Clean pages only; without this a read-back measures RAM. Not every platform or FUSE mount honours it.
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(fd, start, length, os.POSIX_FADV_DONTNEED)

"""Durable file operations: the temp → fsync → rename → fsync(dir) protocol, and nothing else.

A file written through :func:`write_file_atomic` either exists complete at its final name after a crash, or
not at all (a leftover ``.<name>.<random>.part`` temp file is garbage that resume deletes).
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from resumerge import killpoints
from resumerge.errors import StorageError

TEMP_SUFFIX = ".part"


def temp_path(final: Path) -> Path:
    """A unique temp name beside ``final`` (same filesystem, so the rename is atomic)."""
    return final.with_name(f".{final.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def is_temp_name(name: str, planned: set[str]) -> bool:
    """True when ``name`` is one of resumerge's temp files for a planned output name."""
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return False
    stem = name[1 : -len(TEMP_SUFFIX)]
    base, _, token = stem.rpartition(".")
    return base in planned and len(token) == 12


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that renames and unlinks in it survive a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some FUSE filesystems (Drive) cannot fsync directories; the file data itself is synced.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def publish(temp: Path, final: Path) -> None:
    """Rename a fully written, fsynced ``temp`` onto ``final`` and make the rename durable."""
    os.replace(temp, final)
    killpoints.reach("after_rename")
    fsync_dir(final.parent)
    killpoints.reach("after_dir_fsync")


def write_file_atomic(final: Path, data: bytes, *, point: str | None = None) -> None:
    """Write ``data`` to ``final`` durably (temp, fsync, rename, fsync dir).

    ``point`` names a kill point reached after the temp file is written. Raises :class:`StorageError` on
    ENOSPC/EIO/EROFS and similar, after removing the temp file.
    """
    temp = temp_path(final)
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            if point:
                killpoints.reach(point)
            os.fsync(f.fileno())
        publish(temp, final)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise storage_error(exc, final) from exc


def storage_error(exc: OSError, path: Path) -> StorageError:
    """Translate an OS write error into a :class:`StorageError` that says what to do."""
    hints = {
        errno.ENOSPC: "free disk space, then run resumerge resume",
        errno.EDQUOT: "free quota, then run resumerge resume",
        errno.EROFS: "the output filesystem is read-only; remount it writable, then resume",
        errno.EACCES: "check permissions on the output directory, then resume",
        errno.EFBIG: "the file size limit was hit; raise it (ulimit -f) or lower --out-shard-size, then resume",
        errno.EIO: "the disk reported an I/O error; check it, then resume",
    }
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return StorageError(
        f"writing {path.name} failed: {reason}", path=str(path), hint=hints.get(exc.errno or 0, "then resume")
    )

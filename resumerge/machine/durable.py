"""Durable file operations: the temp → fsync → rename → fsync(dir) protocol, and nothing else.

A file written through :func:`write_file_atomic` either exists complete at its final name after a crash, or
not at all (a leftover ``.<name>.<random>.part`` temp file is garbage that resume deletes).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.errors import StorageError
from resumerge.machine import killpoints
from resumerge.machine.checksums import hash_file, written_with

if TYPE_CHECKING:
    import torch

TEMP_SUFFIX = ".part"
# Benchmarks only: set to 1 to skip every fsync (files, directories, the ledger's journal) and measure what
# durability costs. A power loss or kernel crash can then lose or tear committed files. Never set it for real merges.
UNSAFE_NO_FSYNC_ENV = "RESUMERGE_UNSAFE_NO_FSYNC"


def durability_disabled() -> bool:
    """True when ``RESUMERGE_UNSAFE_NO_FSYNC=1`` (benchmark-only; see :data:`UNSAFE_NO_FSYNC_ENV`)."""
    return os.environ.get(UNSAFE_NO_FSYNC_ENV) == "1"


def sync_file(fd: int) -> None:
    """fsync ``fd``: its data is on disk when this returns (skipped only under ``RESUMERGE_UNSAFE_NO_FSYNC=1``)."""
    if not durability_disabled():
        os.fsync(fd)


# sync_file_range's flag (linux/fs.h): start write-out of the range's dirty pages, wait for none of it.
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range`` (the C library's), or None elsewhere or when the library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here: status imports this module, and a merge asks this once

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages to disk now, without waiting for them; best effort, never raises.

    Only a speed-up for the :func:`sync_file` that must still follow: the kernel writes dirty pages back on its
    own only once they are 30 s old or fill a tenth of free memory, so a file written in less than that is
    written to disk entirely inside the final fsync, after the work that made it. Started while the file is
    being written, the disk works beside the merge. A no-op where Linux's ``sync_file_range`` is missing and
    under ``RESUMERGE_UNSAFE_NO_FSYNC=1`` (nothing is synced there).
    """
    call = _sync_file_range()
    if call is not None and not durability_disabled():
        call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0, 0: the whole file; an error (EINVAL on FUSE) changes nothing


def discard(path: Path) -> None:
    """Delete a temp file if possible. Failure is ignored: on a read-only or failing disk unlink fails too, and a
    leftover temp file is garbage that the next resume deletes — the error that got us here is what matters."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def temp_path(final: Path) -> Path:
    """A unique temp name beside ``final`` (same filesystem, so the rename is atomic)."""
    import secrets  # here: it imports random, hmac and base64, which `resumerge status` (reading only) never needs

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
    if durability_disabled():
        return
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


def publish_copy(staged: Path, final: Path, sha256: str) -> None:
    """Publish the fsynced local file ``staged`` as ``final`` on another filesystem, trusting nothing there.

    Copy to a temp name beside ``final``, fsync it, read it back and compare its checksum with ``sha256`` (the
    record of the bytes written to ``staged``, by the algorithm it names: :mod:`resumerge.machine.checksums`), then
    rename and fsync the directory; ``staged`` is deleted last.
    A mismatch raises :class:`StorageError` and leaves no file under ``final``'s name. Other OS errors propagate
    as ``OSError`` after the temp copy is removed.
    """
    temp = temp_path(final)
    try:
        with open(staged, "rb") as src, open(temp, "xb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
            dst.flush()
            sync_file(dst.fileno())
        killpoints.reach("after_publish_copy")
        if hash_file(temp, written_with(sha256))[1] != sha256:
            raise StorageError(f"{final.name} read back from {final.parent} differs from what was written",
                               path=str(final), hint="the output filesystem lost data; check it, then resume")
        publish(temp, final)
    except BaseException:
        discard(temp)
        raise
    discard(staged)


def write_file_atomic(final: Path, data: bytes, *, point: str | None = None) -> None:
    """Write ``data`` to ``final`` durably (temp, fsync, rename, fsync dir).

    ``point`` names a kill point reached after the temp file is written. Raises :class:`StorageError` on
    ENOSPC/EIO/EROFS and similar, after removing the temp file.
    """
    temp = temp_path(final)
    try:
        write_synced(temp, data, point)
        publish(temp, final)
    except OSError as exc:
        discard(temp)
        raise storage_error(exc, final) from exc


def write_synced(path: Path, data: bytes, point: str | None = None) -> None:
    """Create ``path`` (a fresh temp name) holding ``data``, fsynced; ``point`` is a kill point before the fsync."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        if point:
            killpoints.reach(point)
        sync_file(f.fileno())


def save_entry(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bool:
    """Keep ``tensors`` (and safetensors ``metadata``) at ``path``, an entry of a cache of a pure function's
    results (an extraction's factors, a transplant's batches): written to a temp file beside it named for this
    process, fsynced, renamed over ``path`` and its folder fsynced, so the entry is whole or absent after a crash.
    Best effort: False, the temp file removed, where the disk refused it (full, read-only), which costs only a
    recomputation."""
    from safetensors.torch import save_file  # imports torch: only once an entry is kept

    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(dict(tensors), str(temp), metadata=metadata)
        fd = os.open(temp, os.O_RDONLY)
        try:
            sync_file(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        fsync_dir(path.parent)
    except OSError:
        discard(temp)
        return False
    return True


def storage_error(exc: OSError, path: Path) -> StorageError:
    """Translate an OS write error into a :class:`StorageError` that says what to do."""
    hints = {
        errno.ENOSPC: "free disk space, then run resumerge resume OUT",
        errno.EDQUOT: "free quota, then run resumerge resume OUT",
        errno.EROFS: "the output filesystem is read-only; remount it writable, then resume",
        errno.EACCES: "check permissions on the output directory, then resume",
        errno.EFBIG: "the file size limit (ulimit -f) was hit; raise it and run resumerge resume OUT, or start over "
        "with a smaller --out-shard-size (--restart)",
        errno.EIO: "the disk reported an I/O error; check it, then resume",
    }
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return StorageError(
        f"writing {path.name} failed: {reason}", path=str(path), hint=hints.get(exc.errno or 0, "then resume")
    )

"""One merge per output directory: an exclusive flock on the run's lock file, and on OUT itself.

The lock on OUT catches two processes that use different state dirs; it is best-effort because some FUSE
filesystems do not support flock on directories. Locks vanish with the process, so a SIGKILLed run never
leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from resumerge.errors import OutputDirError, StorageError, UsageError

LOCK_NAME = "lock"
# Errors of a disk that is full or failing, as opposed to a directory this process may not write in.
_STORAGE_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


class RunLock:
    """Holds the locks of one run until :meth:`release`.

    ``lock_out=False`` takes only the lock file: a recipe holds its own for the whole run while each stage takes
    a stage's locks, and OUT itself is locked by the final stage (two descriptors of one process conflict under
    flock, so the recipe must not hold OUT's).
    """

    def __init__(self, run_dir: Path, out_dir: str | os.PathLike[str], *, lock_out: bool = True) -> None:
        self.run_dir = run_dir
        self.out_dir = out_dir
        self.lock_out = lock_out
        self._fds: list[int] = []

    def acquire(self) -> None:
        """Take the locks; raises :class:`OutputDirError` when another process holds one, :class:`UsageError` when
        the state dir cannot be written in (read-only, permissions, not a directory) and :class:`StorageError` when
        its disk is full or failing."""
        targets = [(self.run_dir / LOCK_NAME, False)]
        if self.lock_out:
            targets.append((Path(self.out_dir), True))
        for path, is_dir in targets:
            try:
                if not is_dir:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDONLY) if is_dir else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                self.release()
                # A full or failing disk is a storage fault (exit 3); a state dir this process may not write in
                # is a setting to change (exit 2): nothing was recorded, so "resume finishes it" would be wrong.
                kind = StorageError if exc.errno in _STORAGE_FAULTS or is_dir else UsageError
                raise kind(
                    f"cannot open {path}: {os.strerror(exc.errno) if exc.errno else exc}", path=str(path),
                    hint="use a writable local state dir (--state-dir DIR or RESUMERGE_STATE_DIR)" if not is_dir
                    else "check that OUT is a readable directory",
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self.release()
                raise OutputDirError(
                    f"another resumerge process is merging into {self.out_dir}",
                    path=str(self.out_dir),
                    hint="wait for it to finish, or stop it (it can be resumed later)",
                ) from None
            except OSError as exc:
                os.close(fd)
                if not is_dir or exc.errno not in (errno.ENOTSUP, errno.EINVAL, errno.ENOLCK):
                    raise
                continue
            self._fds.append(fd)

    def release(self) -> None:
        """Drop the locks (closing the descriptors releases them)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def is_locked(run_dir: Path) -> bool:
    """True when a live process holds the run's lock (used by ``status`` to tell running from interrupted)."""
    return is_held(run_dir / LOCK_NAME)


def is_held(path: Path) -> bool:
    """True when a live process holds the lock file ``path`` (a run's, or a :class:`JobLock`'s)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


class JobLock:
    """One process at a time for a job that is not a merge (a check's journal folder, a measurement's OUT_DIR):
    an exclusive flock on the file ``path``, which then holds the holder's pid and ``holder`` (its command), so a
    second process is refused (:class:`OutputDirError`, exit 4) naming the first: ``what`` (the job in words) "is
    already under way (pid N: COMMAND)". Like :class:`RunLock`'s, it
    vanishes with the process: a killed job leaves nothing to clear. With ``wait`` a second process waits for the
    first instead (a job whose result is shared by content, which the second then finds finished or resumes)."""

    def __init__(self, path: Path, what: str, holder: str, *, hint: str, wait: bool = False) -> None:
        self.path, self.what, self.holder, self.hint, self.wait = path, what, holder, hint, wait
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`OutputDirError` naming the process that holds it; a state dir this
        process may not write in is :class:`UsageError` (exit 2), a full or failing disk :class:`StorageError`."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            kind = StorageError if exc.errno in _STORAGE_FAULTS else UsageError
            raise kind(f"cannot open {self.path}: {os.strerror(exc.errno) if exc.errno else exc}",
                       path=str(self.path), hint="use a writable local folder") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                first = os.read(fd, 4096).decode("utf-8", errors="replace").strip()
            finally:
                os.close(fd)
            raise OutputDirError(f"{self.what} is already under way ({first or 'another process'}; its lock "
                                 f"{self.path})", hint=self.hint) from None
        # Written only by the holder, after it holds the lock: the second process reads who is first.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {self.holder}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it); the file stays, emptied first, so what the job
        leaves behind is the same bytes whichever process ran it (a measurement's folder is compared whole)."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> JobLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def pid_alive(pid: object) -> bool:
    """Whether process ``pid`` (as a pass's progress file records it; anything else: no) still runs."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True

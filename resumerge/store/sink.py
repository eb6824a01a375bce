"""The output sink seam: where the committed files of one output go.

The engine writes every planned file through an :class:`OutputSink` and does not know what is behind it. A
file is streamed to a local temp path the sink hands out (:meth:`OutputSink.temp_for`), fsynced by the writer,
then :meth:`OutputSink.publish`\\ ed. A sink that commits at once (a directory) returns True: the file is durable
under its final name and only the ledger row is missing (the caller writes it next, then the manifest). A sink that
commits later, in batches (a hub repo), returns False: the caller updates the manifest at once (the sink commits it
together with the file) and writes the ledger row only when :meth:`OutputSink.settled` or :meth:`OutputSink.drain`
names the file — so "done" is recorded only after the file is durable, whatever the sink.

Implementations: :class:`LocalDirSink` (temp beside the file, rename, fsync dir) and :class:`StagedDirSink`
(temp on local disk, copy to OUT, read back and compare, rename — for Drive and other FUSE mounts), and
:class:`~resumerge.store.hubsink.HubRepoSink` (staged locally, uploaded, committed to a hub repo in batches).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from resumerge.store.checksums import check_many
from resumerge.store.durable import (
    discard,
    fsync_dir,
    publish,
    publish_copy,
    storage_error,
    temp_path,
    write_file_atomic,
    write_synced,
)


@dataclass(frozen=True)
class Settled:
    """A file a deferred sink has committed since it was published: ``commit`` names the commit holding it."""

    name: str
    commit: str


class OutputSink(ABC):
    """Where one output's files are committed: write durably, check, list, delete what resumerge owns."""

    @abstractmethod
    def where(self, name: str) -> Path:
        """The file ``name`` as the user sees it (for messages)."""

    @abstractmethod
    def temp_for(self, name: str) -> Path:
        """A fresh local path (not yet existing) to write the bytes of planned file ``name`` to."""

    @abstractmethod
    def publish(self, temp: Path, name: str, sha256: str) -> bool:
        """Make the fully written, fsynced ``temp`` (whose bytes hash to ``sha256``) durable as ``name``.

        Returns True when ``name`` is committed on return; False when the sink took ``temp`` over and commits it
        later (then :meth:`settled` or :meth:`drain` names it once it is). Raises ``OSError`` (or a
        :class:`~resumerge.errors.ResumergeError`) and leaves no file under ``name``'s temp names on failure.
        """

    @abstractmethod
    def replace_small(self, name: str, data: bytes) -> None:
        """Atomically replace resumerge's own small bookkeeping file ``name`` (the manifest)."""

    @abstractmethod
    def check(self, files: Iterable[tuple[str, int, str]]) -> Mapping[str, str | None]:
        """For each committed ``(name, size, sha256)``: why it can no longer be trusted, or None when intact."""

    @abstractmethod
    def names(self) -> list[str]:
        """The names of the regular files in the output (links and folders are never resumerge's)."""

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Delete the files ``names``, which the caller knows resumerge wrote; absent ones are skipped."""

    def settled(self) -> list[Settled]:
        """Files committed since the last call, without waiting (a sink that commits at once has none)."""
        return []

    def drain(self) -> list[Settled]:
        """Commit everything published and not yet committed, wait for it, and return what :meth:`settled` has not
        returned yet. Raises like :meth:`publish` when a commit fails for good."""
        return []

    def close(self) -> None:
        """Stop background work (a run that failed or was stopped); what was committed stays committed."""
        return None  # a sink that commits at once has no background work

    def write_small(self, name: str, data: bytes, *, point: str | None = None) -> tuple[str, bool]:
        """Write ``data`` as ``name``; returns its sha256 and whether it is committed on return (see
        :meth:`publish`). ``point`` is a kill point before the fsync.

        Raises :class:`~resumerge.errors.StorageError` on ENOSPC, EIO, EROFS and similar.
        """
        sha = hashlib.sha256(data).hexdigest()
        temp = self.temp_for(name)
        try:
            write_synced(temp, data, point)
            durable = self.publish(temp, name, sha)
        except BaseException as exc:
            discard(temp)
            if isinstance(exc, OSError):
                raise storage_error(exc, self.where(name)) from exc
            raise
        if durable:
            discard(temp)
        return sha, durable


class LocalDirSink(OutputSink):
    """OUT is a directory on a local filesystem: temp file beside the final one, rename, fsync the directory."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def where(self, name: str) -> Path:
        return self.out_dir / name

    def temp_for(self, name: str) -> Path:
        return temp_path(self.out_dir / name)

    def publish(self, temp: Path, name: str, sha256: str) -> bool:
        publish(temp, self.out_dir / name)
        return True

    def replace_small(self, name: str, data: bytes) -> None:
        write_file_atomic(self.out_dir / name, data)

    def check(self, files: Iterable[tuple[str, int, str]]) -> Mapping[str, str | None]:
        return check_many(self.out_dir, files)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.out_dir.iterdir() if p.is_file() and not p.is_symlink())

    def delete(self, names: Iterable[str]) -> None:
        removed = False
        for name in names:
            path = self.out_dir / name
            if path.is_file() and not path.is_symlink():
                path.unlink()
                removed = True
        if removed:
            fsync_dir(self.out_dir)


class StagedDirSink(LocalDirSink):
    """OUT is on a remote filesystem (Drive, NFS, other FUSE mounts): files are written and fsynced on local disk
    under ``staging``, then copied to OUT, read back, compared with the hash of what was written, and renamed."""

    def __init__(self, out_dir: Path, staging: Path) -> None:
        super().__init__(out_dir)
        self.staging = staging

    def temp_for(self, name: str) -> Path:
        return self.staging / temp_path(self.out_dir / name).name

    def publish(self, temp: Path, name: str, sha256: str) -> bool:
        publish_copy(temp, self.out_dir / name, sha256)
        return True

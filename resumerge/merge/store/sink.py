"""The output sink seam: where the committed files of one output go.

The engine writes every planned file through an :class:`OutputSink` and does not know what is behind it. A
file is streamed to a local temp path the sink hands out (:meth:`OutputSink.temp_for`), fsynced by the writer,
then :meth:`OutputSink.publish`\\ ed, which answers with a :class:`Receipt`: already committed for a sink that
commits at once (a folder), committed later for one that commits in batches (a hub repo). What to record when
(ledger row, manifest) is not the sink's business: :class:`~resumerge.merge.store.journal_commit.CommitJournal` runs
that protocol from the receipts alone, so nothing above the sink asks which kind it has.

A sink is a context manager: leaving the ``with`` block stops its background work (what was committed stays).

Implementations: :class:`LocalDirSink` (temp beside the file, rename, fsync dir), :class:`StagedDirSink` (temp
on local disk, copy to OUT, read back and compare, rename — for Drive and other FUSE mounts),
:class:`~resumerge.merge.store.hubsink.HubRepoSink` (staged locally, uploaded, committed to a hub repo in batches) and
:class:`~resumerge.merge.store.memsink.MemorySink` (files in a dict, for tests and notebooks).
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from pathlib import Path
from typing import TypeVar

from resumerge.config.closing import Closing
from resumerge.errors import UsageError
from resumerge.machine.checksums import XXH3_128, Checksum, check_many
from resumerge.machine.durable import fsync_dir, publish, publish_copy, temp_path, write_file_atomic
from resumerge.merge.store.units import partial_name

_T = TypeVar("_T")

class Receipt:
    """What publishing ``name`` returns: a handle on the commit that makes it durable, now or later.

    The sink resolves it — :meth:`settle` with the id of the commit holding the file (None where a commit has no
    id: a folder), or :meth:`fail` with the error that ended its commit; the first answer stands. The journal
    waits on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._future: futures.Future[str | None] = futures.Future()

    @classmethod
    def committed(cls, name: str, commit: str | None = None) -> Receipt:
        """A receipt for a file that is durable already (a sink that commits at once)."""
        receipt = cls(name)
        receipt.settle(commit)
        return receipt

    def settle(self, commit: str | None) -> None:
        """The sink committed the file (in ``commit``, when commits have ids); a receipt already resolved keeps its
        answer (a stopped run's last commit may land after its batch was given up: the resume adopts it)."""
        if not self._future.done():
            self._future.set_result(commit)

    def fail(self, error: BaseException) -> None:
        """The sink's commit of the file failed for good; a receipt already resolved keeps its answer."""
        if not self._future.done():
            self._future.set_exception(error)

    def done(self) -> bool:
        """Whether the sink has answered (committed or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the answer; whether there is one."""
        return not futures.wait([self._future], timeout).not_done

    def error(self) -> BaseException | None:
        """The error that ended the commit, or None (committed). Only once :meth:`done`."""
        return self._future.exception(timeout=0)

    def commit(self) -> str | None:
        """The id of the commit holding the file (None for a folder); raises the commit's error. Only once
        :meth:`done`."""
        return self._future.result(timeout=0)


class OutputSink(Closing):
    """Where one output's files are committed: write durably, check, list, delete what resumerge owns.

    Besides the seven methods every sink implements, a sink that commits later overrides :meth:`flush`,
    :meth:`stop` and :meth:`commit_when` (and sets :attr:`commits_later`); one that holds background work or
    resources overrides :meth:`close`."""

    # The checksum a new run records the files it commits here with (a run continued keeps the one its records
    # use: resumerge.machine.checksums): xxh3-128, unless the place names files by another (a hub's LFS: sha256).
    checksum: Checksum = XXH3_128
    # Whether published files are committed later (in batches), so that a file may be published (say, uploaded)
    # before it may be committed: see :meth:`commit_when`.
    commits_later = False
    # Whether a file planned in units (a GGUF output) is written in place, unit by unit, at :meth:`partial_for`, so
    # that an interrupted run keeps the units it wrote (:mod:`resumerge.merge.store.units`); False: every file is
    # committed whole (a hub repo commits files, a staged copy to Drive copies files).
    writes_in_place = False

    @abstractmethod
    def where(self, name: str) -> Path:
        """The file ``name`` as the user sees it (for messages)."""

    @abstractmethod
    def temp_for(self, name: str) -> Path:
        """A fresh local path (not yet existing) to write the bytes of planned file ``name`` to."""

    @abstractmethod
    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        """Make the fully written, fsynced ``temp`` (whose bytes hash to ``sha256``, a record of
        :mod:`~resumerge.machine.checksums` naming its algorithm) durable as ``name``.

        The receipt is settled on return when ``name`` is committed then; otherwise the sink took ``temp`` over and
        settles the receipt once a commit holds it (with the newest manifest :meth:`replace_small` was given).
        Raises ``OSError`` (or a :class:`~resumerge.errors.ResumergeError`) and leaves no file under ``name``'s
        temp names on failure.
        """

    @abstractmethod
    def replace_small(self, name: str, data: bytes) -> None:
        """Atomically replace resumerge's own small bookkeeping file ``name`` (the manifest)."""

    @abstractmethod
    def check(self, files: Iterable[tuple[str, int, str]]) -> Mapping[str, str | None]:
        """For each committed ``(name, size, recorded checksum)``: why it can no longer be trusted, or None when
        intact."""

    @abstractmethod
    def names(self) -> list[str]:
        """The names of the regular files in the output (links and folders are never resumerge's)."""

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Delete the files ``names``, which the caller knows resumerge wrote; absent ones are skipped."""

    def partial_for(self, name: str) -> Path:
        """Where planned file ``name`` is written in place until it is complete (the same path on every run, on the
        filesystem it is published to: :meth:`publish` renames it). Only for a sink that :attr:`writes_in_place`."""
        raise NotImplementedError(f"{type(self).__name__} commits every file whole")

    def reclaim(self, name: str) -> None:
        """Move the file ``name``, complete but not journaled (a process killed between its rename and its ledger
        row), back to :meth:`partial_for`, so that its journaled units are checked and kept. Only for a sink that
        :attr:`writes_in_place`."""
        raise NotImplementedError(f"{type(self).__name__} commits every file whole")

    def commit_when(self, name: str, ready: Callable[[], bool]) -> None:
        """Commit the file ``name``, about to be published, only once ``ready()`` is true (the input files it was
        computed from are checked); ``ready`` may raise the error that failed them. Only for a sink that
        :attr:`commits_later`: the engine waits before publishing to any other."""
        raise NotImplementedError(f"{type(self).__name__} commits at once: wait before publishing")

    def flush(self) -> None:
        """Commit everything published now, with the newest manifest, and wait for it (the run's last files); may
        return early when the run is stopping. Raises like :meth:`publish` when a commit fails for good."""
        return None  # a sink that commits at once has nothing waiting

    def stop(self) -> list[Receipt]:
        """The run is stopping: commit no new batch, but start one last commit of what is already uploaded; returns
        the receipts that commit settles (or fails). Never raises: the run is being interrupted."""
        return []  # a sink that commits at once has nothing waiting

    def close(self) -> None:
        """Stop background work (a run that failed or was stopped); what was committed stays committed."""
        return None  # a sink that commits at once has no background work


class LocalDirSink(OutputSink):
    """OUT is a directory on a local filesystem: temp file beside the final one, rename, fsync the directory.

    ``reads`` are the real paths of the files the run reads (its inputs): whatever decided it (``--restart``,
    reconcile, a publish), the sink never deletes or replaces one of them; it raises :class:`UsageError` instead.
    The planner refuses an OUT over an input first (:func:`resumerge.merge.plan.outguard.refuse_out_over_inputs`): this
    is the second line, at the only place OUT's files are removed or replaced."""

    writes_in_place = True

    def __init__(self, out_dir: Path, *, reads: frozenset[str] = frozenset()) -> None:
        self.out_dir = out_dir
        self.reads = reads

    def where(self, name: str) -> Path:
        return self.out_dir / name

    def partial_for(self, name: str) -> Path:
        return self.out_dir / partial_name(name)

    def reclaim(self, name: str) -> None:
        self._spare_inputs([name])
        os.replace(self.out_dir / name, self.partial_for(name))
        fsync_dir(self.out_dir)

    def temp_for(self, name: str) -> Path:
        return temp_path(self.out_dir / name)

    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        self._spare_inputs([name])
        publish(temp, self.out_dir / name)
        return Receipt.committed(name)

    def replace_small(self, name: str, data: bytes) -> None:
        self._spare_inputs([name])
        write_file_atomic(self.out_dir / name, data)

    def check(self, files: Iterable[tuple[str, int, str]]) -> Mapping[str, str | None]:
        return check_many(self.out_dir, files)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.out_dir.iterdir() if p.is_file() and not p.is_symlink())

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        self._spare_inputs(names)  # all checked before the first is deleted
        removed = False
        for name in names:
            path = self.out_dir / name
            if path.is_file() and not path.is_symlink():
                path.unlink()
                removed = True
        if removed:
            fsync_dir(self.out_dir)

    def _spare_inputs(self, names: Iterable[str]) -> None:
        """Raise UsageError (exit 2) when one of ``names`` in OUT is a file the run reads."""
        if not self.reads:
            return
        for name in names:
            path = self.out_dir / name
            if os.path.realpath(path) in self.reads:
                raise UsageError(f"{path} is a file this run reads as an input: resumerge never deletes or "
                                 "overwrites an input", path=str(path),
                                 hint="write the output to a new folder outside the inputs' folders")


class StagedDirSink(LocalDirSink):
    """OUT is on a remote filesystem (Drive, NFS, other FUSE mounts): files are written and fsynced on local disk
    under ``staging``, then copied to OUT, read back, compared with the hash of what was written, and renamed.
    Every file is committed whole: a file copied to OUT whole is the unit a copy can check."""

    writes_in_place = False

    def __init__(self, out_dir: Path, staging: Path, *, reads: frozenset[str] = frozenset()) -> None:
        super().__init__(out_dir, reads=reads)
        self.staging = staging

    def temp_for(self, name: str) -> Path:
        return self.staging / temp_path(self.out_dir / name).name

    def publish(self, temp: Path, name: str, sha256: str) -> Receipt:
        self._spare_inputs([name])
        publish_copy(temp, self.out_dir / name, sha256)
        return Receipt.committed(name)

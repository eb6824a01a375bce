"""The commit protocol's one owner: publish a file through the sink, then journal it in durability order.

"Done" is recorded only after the file is durable, whatever the sink. A file whose :class:`~resumerge.merge.store.sink.
Receipt` is settled when :meth:`~resumerge.merge.store.sink.OutputSink.publish` returns (a folder) gets its ledger row
at once, then the manifest lists it. A file committed later (a hub repo, which commits the manifest together with
the files it lists) is listed in the manifest at once, and gets its ledger row when its receipt is settled. A
kill between any two steps leaves a state the resume repairs: a durable file without a ledger row is re-hashed
against the manifest or made again, a manifest entry without a durable file is dropped. The kill points
``after_ledger_commit`` and ``after_manifest_write`` mark those steps (:mod:`resumerge.machine.killpoints`).

A stopped run asks the sink for one last commit of what it has uploaded (:meth:`CommitJournal.stop`) and waits
for it boundedly (:meth:`CommitJournal.stopped`); a sink that commits at once has nothing to wait for.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from resumerge.errors import ResumergeError
from resumerge.machine import killpoints
from resumerge.machine.checksums import Checksum
from resumerge.machine.durable import discard, storage_error, write_synced
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import ManifestBook
from resumerge.merge.store.sink import OutputSink, Receipt


@dataclass(frozen=True)
class _Waiting:
    """A published file whose commit is still to come, with what its ledger row will say."""

    receipt: Receipt
    size: int
    sha256: str
    seconds: float
    tensors: tuple[str, ...]


class CommitJournal:
    """Journals the files published through ``sink`` into ``ledger`` and the manifest ``book``.

    Called from the writer thread while the run computes, and from the calling thread once the writer stopped.
    :attr:`checksum` is what every file and unit of the run is recorded with: the algorithm of the ledger's
    committed records, else the sink's (:mod:`resumerge.machine.checksums`)."""

    def __init__(self, sink: OutputSink, ledger: Ledger, book: ManifestBook) -> None:
        self.sink, self.ledger, self.book = sink, ledger, book
        self.checksum: Checksum = ledger.records_checksum() or sink.checksum
        self._waiting: dict[str, _Waiting] = {}  # in publish order
        self._lock = threading.Lock()
        self._last: list[Receipt] = []

    def record(self, receipt: Receipt, size: int, sha256: str, *, seconds: float = 0.0,
               tensors: tuple[str, ...] = (), manifest_point: bool = True) -> None:
        """Journal the file ``receipt`` names, just published with ``size`` bytes hashing to ``sha256`` (the record
        of :attr:`checksum`'s digest).

        ``manifest_point``: whether ``after_manifest_write`` is reached after the manifest lists it (shards)."""
        name = receipt.name
        if receipt.done():
            receipt.commit()  # raises the commit's error: a failed file is never recorded
            self.ledger.commit_file(name, size=size, sha256=sha256, seconds=seconds, tensors=tensors)
            killpoints.reach("after_ledger_commit")
            self.book.commit(name, size, sha256)
            if manifest_point:
                killpoints.reach("after_manifest_write")
            return
        with self._lock:
            self._waiting[name] = _Waiting(receipt, size, sha256, seconds, tensors)
        self.book.commit(name, size, sha256)  # the sink commits it together with the file
        self.settle()

    def write_small(self, name: str, data: bytes, *, point: str | None = None) -> None:
        """Write, publish and journal the small file ``name`` (config, index, card, tokenizer); ``point`` is a kill
        point before the fsync.

        Raises :class:`~resumerge.errors.StorageError` on ENOSPC, EIO, EROFS and similar.
        """
        sha = self.checksum.of(data)
        temp = self.sink.temp_for(name)
        try:
            write_synced(temp, data, point)
            receipt = self.sink.publish(temp, name, sha)
        except BaseException as exc:
            discard(temp)
            if isinstance(exc, OSError):
                raise storage_error(exc, self.sink.where(name)) from exc
            raise
        if receipt.done():
            discard(temp)  # otherwise the sink took it over until its commit
        self.record(receipt, len(data), sha, manifest_point=False)

    def settle(self, *, strict: bool = True) -> None:
        """Write the ledger rows of waiting files whose commit landed, in publish order, and each commit's id as an
        event. ``strict``: raise the error of a commit that failed for good (a stopped run only journals)."""
        with self._lock:
            answered = [(name, w) for name, w in self._waiting.items() if w.receipt.done()]
        failure: BaseException | None = None
        commits: dict[str, list[str]] = {}
        for name, waiting in answered:
            error = waiting.receipt.error()
            if error is not None:
                failure = failure or error
                continue
            with self._lock:
                del self._waiting[name]
            self.ledger.commit_file(name, size=waiting.size, sha256=waiting.sha256, seconds=waiting.seconds,
                                    tensors=waiting.tensors)
            commit = waiting.receipt.commit()
            if commit is not None:
                commits.setdefault(commit, []).append(name)
        for commit, names in commits.items():
            self.ledger.event("commit", f"commit {commit}: {', '.join(names)}", {"commit": commit, "files": names})
        if strict and failure is not None:
            raise failure

    def finish(self) -> list[str]:
        """Have the sink commit everything published, wait for it and journal it; returns the files still waiting
        (the wait ended early because the run is stopping). Raises the error of a commit that failed for good."""
        self.sink.flush()
        self.settle()
        with self._lock:
            return sorted(self._waiting)

    def stop(self) -> int:
        """The run is stopping: have the sink start one last commit of what it already uploaded; returns how many
        files it covers (0 for a sink that commits at once)."""
        self._last = self.sink.stop()
        return len(self._last)

    def stopped(self, timeout: float) -> str | None:
        """Wait up to ``timeout`` seconds for the last commit of :meth:`stop` and journal every file committed by
        then; returns why the last commit did not happen (None when it did). Never raises the sink's error: the
        run is being interrupted, and the resume makes again what was not committed."""
        end = time.monotonic() + timeout
        for receipt in self._last:
            # Short waits: a second Ctrl-C (KeyboardInterrupt in this thread) lands between them at once.
            while not receipt.done() and (left := end - time.monotonic()) > 0:
                receipt.wait(min(0.1, left))
        self.settle(strict=False)
        if not all(r.done() for r in self._last):
            return f"it did not finish within {timeout:g} s"
        error = next((e for r in self._last if (e := r.error()) is not None), None)
        if error is None:
            return None
        return error.one_line() if isinstance(error, ResumergeError) else f"{type(error).__name__}: {error}"

"""Integrity of hub bytes read by HTTP Range, for a merge's streamed inputs and a check's hub models alike: nothing
from the hub is trusted without a checksum.

A streamed range never lands on disk, so it cannot be verified the way a download is (one sha256 over the file).
Instead (:class:`StreamHashes`) each range's sha256 is recorded when it is first read (a merge's ledger, a check's
journal: a :class:`RangeRecord`); any later read of the same range — a resume after a kill, on this machine or
another — must give the same bytes, or the run stops with exit 4 naming the file. And when a run reads every byte of
a file (:class:`FileDigest`), the file is checked against the hub's checksum: its bytes are hashed as they arrive,
with the bytes known without reading them (the header the run was planned from, a GGUF's zero padding:
:func:`~resumerge.inputs.hub.headercheck.known_bytes`) fed first. Ranges arrive roughly in file order (a merge's
plan and a check's passes read tensors in file order, a few at a time), so a digest fed in order needs to hold only
the few ranges that came early; past :data:`MAX_HELD` bytes held it gives up (the per-range hashes still stand)
rather than grow.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from resumerge.errors import RefusedError
from resumerge.inputs.gguf.header import GgufHeader
from resumerge.inputs.hub.headercheck import known_bytes
from resumerge.inputs.safetensors_format import Header

MAX_HELD = 64 * 1024 * 1024
_SPILL_BLOCK = 16 * 1024 * 1024
# What a merge says of a streamed file that failed its check: the check's own words are its.
MERGE_STOPPED = "the merge stopped, and shards already committed from it are suspect"
MERGE_HINT = ("start over with resumerge run CONFIG OUT --restart once the hub serves the file intact (or without "
              "--stream-inputs: downloads are verified first)")


class StreamedInputChanged(RefusedError):
    """A streamed input gave other bytes than recorded or than the hub's checksum says (exit 4)."""


class FileDigest:
    """Hashes one file fed by ranges in any order; calls ``done(ok)`` once every byte has been fed.

    ``expected`` is the hub's identity of the file: 64 hex digits for sha256, 40 for the git blob sha1. ``spill``: a
    folder where ranges that came early are kept past :data:`MAX_HELD` bytes held in memory (each in a file of its
    own, deleted once hashed), rather than giving up: a check reads the tensors outside the decoder layers first,
    some at the end of their file (a GGUF's head), larger than any bound on memory.
    """

    def __init__(self, where: str, size: int, expected: str, done: Callable[[bool], None], *,
                 stopped: str = MERGE_STOPPED, hint: str = MERGE_HINT, spill: Path | None = None) -> None:
        self.where, self.size, self.expected = where, size, expected
        self._stopped, self._hint, self._spill = stopped, hint, spill
        if len(expected) == 64:
            self._hash = hashlib.sha256()
        else:
            self._hash = hashlib.sha1()
            self._hash.update(b"blob %d\0" % size)
        self._next = 0
        self._held: dict[int, tuple[int, bytes | Path]] = {}  # start -> (length, the bytes or the file holding them)
        self._held_bytes = 0
        self._done = done
        self._lock = threading.Lock()
        self.abandoned = False

    def feed(self, start: int, data: bytes | bytearray) -> None:
        """Add bytes ``[start, start + len(data))``; overlaps with bytes already fed are ignored. Raises
        :class:`StreamedInputChanged` when the last byte arrives and the digest is not the hub's."""
        with self._lock:
            if self.abandoned or self._next >= self.size:
                return
            end = start + len(data)
            if end <= self._next:
                return
            if start > self._next:
                if start in self._held:  # read twice before its turn (a check's kept span): held once
                    if self._held[start][0] >= len(data):
                        return
                    self._release(self._held.pop(start))
                if self._held_bytes + len(data) <= MAX_HELD:
                    self._held[start] = (len(data), bytes(data))
                    self._held_bytes += len(data)
                elif self._spill is not None:
                    self._held[start] = (len(data), self._spilled(start, data))
                else:
                    self.abandoned = True
                    self._forget()
                return
            self._hash.update(memoryview(data)[self._next - start:])
            self._next = end
            self._drain()
            if self._next < self.size:
                return
            ok = self._hash.hexdigest() == self.expected
        self._done(ok)
        if not ok:
            raise StreamedInputChanged(
                f"{self.where} does not match the hub's checksum {self.expected[:12]} after reading every byte; "
                f"{self._stopped}", path=self.where, hint=self._hint)

    @property
    def complete(self) -> bool:
        """Whether every byte has been fed (and the checksum compared)."""
        with self._lock:
            return not self.abandoned and self._next >= self.size

    def _drain(self) -> None:
        while self._held:
            first = min(self._held)
            if first > self._next:
                return
            length, data = entry = self._held.pop(first)
            if first + length > self._next:
                if isinstance(data, Path):
                    self._hash_file(data, self._next - first)
                else:
                    self._hash.update(memoryview(data)[self._next - first:])
                self._next = first + length
            self._release(entry)

    def _release(self, entry: tuple[int, bytes | Path]) -> None:
        length, data = entry
        if isinstance(data, Path):
            data.unlink(missing_ok=True)
        else:
            self._held_bytes -= length

    def _spilled(self, start: int, data: bytes | bytearray) -> Path:
        assert self._spill is not None
        self._spill.mkdir(parents=True, exist_ok=True)
        path = self._spill / f"{hashlib.sha256(self.where.encode()).hexdigest()[:16]}-{start}"
        path.write_bytes(data)
        return path

    def _hash_file(self, path: Path, skip: int) -> None:
        """Hash a spilled range's bytes from ``skip`` on, a block at a time."""
        with path.open("rb") as f:
            f.seek(skip)
            while block := f.read(_SPILL_BLOCK):
                self._hash.update(block)

    def _forget(self) -> None:
        for entry in self._held.values():
            self._release(entry)
        self._held, self._held_bytes = {}, 0

    def close(self) -> None:
        """Delete what is held (a run that stops before every byte is fed)."""
        with self._lock:
            self._forget()


def whole_file_digest(where: str, header: Header | GgufHeader, expected: str, done: Callable[[bool], None], *,
                      stopped: str = MERGE_STOPPED, hint: str = MERGE_HINT, spill: Path | None = None
                      ) -> tuple[list[tuple[int, int]], FileDigest] | None:
    """The spans of a file of ``header`` a run must read for the file to be checked whole, and the
    :class:`FileDigest` to feed them to, the bytes known without reading them (``header``'s own, a GGUF's padding)
    fed already; None for a file that cannot be checked so (bytes between its header and its data, or no hub
    checksum ``expected``)."""
    known = known_bytes(header)
    if known is None or not expected:
        return None
    digest = FileDigest(where, header.file_size, expected, done, stopped=stopped, hint=hint, spill=spill)
    for start, data in known[1]:
        digest.feed(start, data)
    return known[0], digest


class RangeRecord(Protocol):
    """Where the sha256 of each range read is recorded, first read wins: a merge's
    :class:`~resumerge.merge.store.ledger.Ledger`, or a check's journal of its hub reads."""

    def remember_read(self, model: str, file: str, start: int, end: int, sha256: str) -> str:
        """Record ``sha256`` for bytes ``[start, end)`` of ``file`` of ``model`` unless one is recorded; return the
        recorded one."""


class StreamHashes:
    """Checks streamed ranges against a :class:`RangeRecord` once one is attached (before that, nothing is read),
    and feeds each to its file's :class:`FileDigest` where the run reads the file whole. ``changed`` says what the
    run did about a range that gave other bytes, ``hint`` what to do next (a merge's words unless told)."""

    def __init__(self, *, changed: str = "nothing from it was merged",
                 hint: str = "the hub served changed content for a pinned commit; retry later, or start over with "
                             "resumerge run CONFIG OUT --restart") -> None:
        self.ledger: RangeRecord | None = None
        self.after: Callable[[], None] | None = None  # called after each range is checked (progress)
        self.digests: dict[tuple[str, str], FileDigest] = {}  # files this run reads whole: checked entire
        self._changed, self._hint = changed, hint

    def check(self, model: str, file: str, start: int, end: int, data: bytearray) -> None:
        """Record the sha256 of ``data`` (bytes ``[start, end)`` of ``file`` of ``model``), or compare it with
        the recorded one. Raises :class:`StreamedInputChanged` on a mismatch."""
        self.check_digest(model, file, start, end, hashlib.sha256(data).hexdigest())
        whole = self.digests.get((model, file))
        if whole is not None:
            whole.feed(start, data)
        if self.after is not None:
            self.after()

    def check_digest(self, model: str, file: str, start: int, end: int, digest: str) -> None:
        """Record ``digest``, the sha256 of bytes ``[start, end)`` of ``file`` of ``model`` (read here, or on a
        cluster node), or compare it with the recorded one. Raises :class:`StreamedInputChanged` on a mismatch."""
        if self.ledger is None:
            raise RuntimeError("internal: a streamed input was read before the run's ledger was attached")
        recorded = self.ledger.remember_read(model, file, start, end, digest)
        if recorded != digest:
            raise StreamedInputChanged(
                f"input {model} file {file} gave other bytes for [{start}, {end}) than when this run first read "
                f"them; {self._changed}", path=file, hint=self._hint)

"""The whole-file check of a streamed input: when a run reads every byte of a file, its hub checksum is verified.

A download is verified once against the hub's sha256 (or git blob sha1); a streamed file never exists on disk, so
its bytes are hashed as they arrive instead. Ranges arrive roughly in file order (the plan reads tensors in file
order, a few at a time), so a digest fed in order needs to hold only the few ranges that came early; past
:data:`MAX_HELD` bytes held it gives up (the per-tensor hashes of the ledger still stand) rather than grow.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

from resumerge.errors import RefusedError

MAX_HELD = 64 * 1024 * 1024


class StreamedInputChanged(RefusedError):
    """A streamed input gave other bytes than recorded or than the hub's checksum says (exit 4)."""


class FileDigest:
    """Hashes one file fed by ranges in any order; calls ``done(ok)`` once every byte has been fed.

    ``expected`` is the hub's identity of the file: 64 hex digits for sha256, 40 for the git blob sha1.
    """

    def __init__(self, where: str, size: int, expected: str, done: Callable[[bool], None]) -> None:
        self.where, self.size, self.expected = where, size, expected
        if len(expected) == 64:
            self._hash = hashlib.sha256()
        else:
            self._hash = hashlib.sha1()
            self._hash.update(b"blob %d\0" % size)
        self._next = 0
        self._held: dict[int, bytes] = {}
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
                if self._held_bytes + len(data) > MAX_HELD:
                    self.abandoned, self._held = True, {}
                    return
                self._held[start] = bytes(data)
                self._held_bytes += len(data)
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
                "the merge stopped, and shards already committed from it are suspect",
                path=self.where, hint="start over with resumerge run CONFIG OUT --restart once the hub serves the "
                                      "file intact (or without --stream-inputs: downloads are verified first)")

    def _drain(self) -> None:
        while self._held:
            first = min(self._held)
            if first > self._next:
                return
            data = self._held.pop(first)
            self._held_bytes -= len(data)
            if first + len(data) > self._next:
                self._hash.update(memoryview(data)[self._next - first:])
                self._next = first + len(data)

"""The digests of the byte ranges a run reads of its local input files, taken in the reads the merge makes anyway.

A file's ``xxh3-128r`` digest (:mod:`resumerge.inputs.contents` records it) is the xxh3-128 of the xxh3-128 digests
(16 bytes each) of the distinct ranges the plan reads of it, in file order (by start, then end). Units read out of
file order and each hashes the range it just read (:meth:`ReadDigests.took`, called by
:class:`~resumerge.inputs.source.LocalFiles`); the proof hashes the ranges no read has hashed (:meth:`ReadDigests.
hash_rest`), from the last one the units will read back towards the first, so the two meet and each range is read
for its digest once, by whoever reaches it first: the record is the same whoever hashed which range.

Nothing here trusts a unit's hash more than the proof's: a range the proof claimed is never hashed by a unit, a range
both hashed must agree, and the file must look at the end (size, mtime, ctime, inode) as it did before the first read
(:meth:`ReadDigests.digest`), else it changed while it was read. A read this file has no range for (a row range, a
pickled ``.bin``'s storage, a hub file) is not hashed here; what the reads never hash, the proof does.

May import: errors (through :mod:`.looks`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import xxhash

from resumerge.errors import PlanChangedError
from resumerge.inputs import looks
from resumerge.inputs.looks import Look, hash_spans, look_of

RANGES = "xxh3-128r"  # the records' name of this digest form (before the ranges' own name)
# The distinct [start, end) byte ranges a plan reads of a file, sorted by start then end.
Ranges = tuple[tuple[int, int], ...]
_BATCH = 64 << 20  # the proof claims this many bytes at a time, then sees again what the reads hashed meanwhile


def ranges_method(ranges: Ranges) -> str:
    """The records' name of a digest of ``ranges``: the form and which ranges (two plans reading other ranges of
    one file never share a record)."""
    return f"{RANGES}:{xxhash.xxh3_64_hexdigest(repr(ranges).encode())}"


def combined(digests: Iterable[bytes]) -> str:
    """The file's digest (hex) from its ranges' 16-byte digests, in file order."""
    total = xxhash.xxh3_128()
    for digest in digests:
        total.update(digest)
    return total.hexdigest()


class _File:
    """One file's ranges, their digests as taken, and how it looked before the first read."""

    def __init__(self, path: Path, ranges: Ranges, ranks: Mapping[tuple[int, int], int]) -> None:
        self.ranges = ranges
        self.digests: list[bytes | None] = [None] * len(ranges)
        self.claimed = [False] * len(ranges)  # by the proof: a read leaves them to it
        # The proof's order: the ranges the units read last first (a range no order names: first of all).
        self.back = sorted(range(len(ranges)), key=lambda i: -ranks.get(ranges[i], len(ranks)))
        self.last = max((ranks.get(r, 0) for r in ranges), default=0)  # when the units read the last of it
        self.conflict = False
        self.look: Look = look_of(path)
        self.started = time.time_ns()  # after the look: a write after it moves the look


class ReadDigests:
    """The per-range digests of the files of ``ranges`` (path to its :data:`Ranges`), those not taken yet hashed by
    the proof in the reverse of ``order`` ((path, start, end) in the order the units read them); each file's look is
    taken now, before any read. Thread-safe: units call :meth:`took` from their threads. Raises ``OSError`` for a
    file that is gone."""

    def __init__(self, ranges: Mapping[str, Ranges], order: Iterable[tuple[str, int, int]] = ()) -> None:
        ranks: dict[str, dict[tuple[int, int], int]] = {path: {} for path in ranges}
        for i, (path, start, end) in enumerate(order):
            found = ranks.get(path)
            if found is not None:
                found.setdefault((start, end), i)
        self._files = {path: _File(Path(path), spans, ranks[path]) for path, spans in ranges.items()}
        self._slots = {(path, start, end): (f, i) for path, f in self._files.items()
                       for i, (start, end) in enumerate(f.ranges)}
        self._lock = threading.Lock()

    def __contains__(self, path: object) -> bool:
        return path in self._files

    def ranges(self, path: str) -> Ranges:
        """The ranges of ``path`` its digest covers."""
        return self._files[path].ranges

    def last_read(self, path: str) -> int:
        """When (a rank in the units' order) the units read the last range of ``path``: the proof hashes the files
        read last first."""
        return self._files[path].last

    def left(self, path: str) -> int:
        """The bytes of ``path``'s ranges no one has hashed or claimed yet."""
        f = self._files[path]
        with self._lock:
            return sum(end - start for (start, end), d, c in zip(f.ranges, f.digests, f.claimed) if d is None and not c)

    def settled(self, path: str) -> None:
        """The records vouch for ``path``: its reads hash nothing more."""
        f = self._files[path]
        with self._lock:
            f.claimed = [True] * len(f.ranges)

    def took(self, path: str, start: int, end: int, data: memoryview) -> None:
        """A unit read ``data``, bytes ``[start, end)`` of ``path``: hashed when it is a range of the file that no
        one has hashed or claimed yet (a thread of the proof racing this one: both must agree)."""
        slot = self._slots.get((path, start, end))
        if slot is None:
            return
        f, i = slot
        if f.digests[i] is not None or f.claimed[i]:  # read without the lock: a stale answer only hashes twice
            return
        self._give(f, i, xxhash.xxh3_128_digest(data))

    def _give(self, f: _File, i: int, digest: bytes) -> None:
        with self._lock:
            held = f.digests[i]
            if held is None:
                f.digests[i] = digest
            elif held != digest:
                f.conflict = True

    def hash_rest(self, path: Path, changed: Callable[[], PlanChangedError]) -> None:
        """Hash every range of ``path`` no read has hashed, the last read first, a batch at a time (a range a unit
        hashes meanwhile is skipped); raises ``changed()`` for a file that changed while it was read."""
        f = self._files[str(path)]
        cursor = 0
        while True:
            batch: list[int] = []
            size = 0
            with self._lock:
                while cursor < len(f.back) and size < _BATCH:
                    i = f.back[cursor]
                    cursor += 1
                    if f.digests[i] is None and not f.claimed[i]:
                        f.claimed[i] = True
                        batch.append(i)
                        size += f.ranges[i][1] - f.ranges[i][0]
            if not batch:
                return
            batch.sort(key=lambda i: f.ranges[i])  # read in file order
            hashers = [xxhash.xxh3_128() for _ in batch]
            hash_spans(path, [((f.ranges[i],), h) for i, h in zip(batch, hashers)], changed)
            for i, h in zip(batch, hashers):
                self._give(f, i, h.digest())

    def digest(self, path: Path, changed: Callable[[], PlanChangedError]) -> tuple[Look, int, str]:
        """``path``'s look before its first read (ctime -1 where written within a timestamp tick of it: a later
        write could keep the look), when that was (ns) and its digest (hex), once every range is hashed
        (:meth:`hash_rest` ended); raises ``changed()`` where the file changed while it was read."""
        f = self._files[str(path)]
        with self._lock:
            digests, conflict = list(f.digests), f.conflict
        if conflict or any(d is None for d in digests):
            raise changed()
        try:
            now = look_of(path)
        except FileNotFoundError:
            raise changed() from None
        if now != f.look:
            raise changed()
        size, mtime, ctime, inode = f.look
        racy = max(mtime, ctime) + looks.RACY_WINDOW_NS >= f.started  # looked up now: a test sets it
        return (size, mtime, -1 if racy else ctime, inode), f.started, combined(d for d in digests if d is not None)

"""The digests of the byte ranges a run reads of its local input files, taken in the reads the merge makes anyway.

A file's ``xxh3-128r`` digest (:mod:`resumerge.inputs.contents` records it) is the xxh3-128 of the xxh3-128 digests
(16 bytes each) of the distinct ranges the plan reads of it, in file order (by start, then end). Units read out of
file order and each hashes the range it reads as it reads it (:meth:`ReadDigests.hasher`, :meth:`ReadDigests.took`,
called by :class:`~resumerge.inputs.source.LocalFiles`); the proof hashes the ranges no read has: the record is the same
whoever hashed which range.

When the proof runs beside the merge, no shard is committed before every digest is recorded, so the proof must end
by the first commit and no earlier than it needs to. It first hashes the ranges the units read only after the first
shard (``first``: the ranges that shard reads, the units hash those on their way), from the last one the units read
back towards the first, skipping those the units hashed meanwhile; then it waits until the units have hashed the
first shard's ranges, or a commit asks for the proof (:meth:`ReadDigests.need`), and hashes whatever is left.

A range shorter than :data:`SMALL` is the proof's alone: a unit hands a range over at a cost of its own (a hash
object, a lock, the digest's record), more than the proof's cost of reading those few bytes again beside others
(a run of nearby small ranges read at once, each hashed from the buffer in one call). A model of tiny tensors (90k
of them) is then proved in one pass over its files, and its table holds neither a slot nor an order for them.

Nothing here trusts a unit's hash more than the proof's: a range the proof claimed is never hashed by a unit, a range
both hashed must agree, and the file must look at the end (size, mtime, ctime, inode) as it did before the first read
(:meth:`ReadDigests.digest`), else it changed while it was read. A read this file has no range for (a row range, a
pickled ``.bin``'s storage, a hub file) is not hashed here; what the reads never hash, the proof does.

May import: errors (through :mod:`.looks`).
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

import xxhash

from resumerge.errors import PlanChangedError
from resumerge.inputs import looks
from resumerge.inputs.looks import Look, hash_spans, look_of

RANGES = "xxh3-128r"  # the records' name of this digest form (before the ranges' own name)
# The distinct [start, end) byte ranges a plan reads of a file, sorted by start then end.
Ranges = tuple[tuple[int, int], ...]
_BATCH = 64 << 20  # the proof claims this many bytes at a time, then sees again what the reads hashed meanwhile
# A range shorter than this is hashed by the proof, never in a unit's read: see the module's docstring and
# bench/RESULTS.md (issue 72, many72) for the costs measured each way.
SMALL = 2048
_INDEX = (1 << 32) - 1  # a slot's range index (its file's number above)
_GAP = 64 << 10  # small ranges this close are read together: the bytes between them cost less than another read
_BLOCK = 8 << 20  # the most one read of small ranges takes at once


class Abandoned(Exception):
    """The run ended before its proof did (:meth:`ReadDigests.stop`): nothing of it is recorded."""


def ranges_method(ranges: Ranges) -> str:
    """The records' name of a digest of ``ranges``: the form and which ranges (two plans reading other ranges of
    one file never share a record)."""
    return f"{RANGES}:{xxhash.xxh3_64_hexdigest(repr(ranges).encode())}"


def hashed_in_reads(ranges: Mapping[str, Ranges]) -> bool:
    """Whether any of ``ranges`` (path to its ranges) is long enough to be hashed in a unit's read: else the proof
    hashes every one, and needs neither the order of the plan's reads nor its first shard's."""
    return any(end - start >= SMALL for spans in ranges.values() for start, end in spans)


def combined(digests: Iterable[bytes]) -> str:
    """The file's digest (hex) from its ranges' 16-byte digests, in file order."""
    return xxhash.xxh3_128_hexdigest(b"".join(digests))  # as fed one by one, in one call


class _File:
    """One file's ranges, their digests as taken, and how it looked before the first read."""

    def __init__(self, path: Path, ranges: Ranges, first: Collection[tuple[int, int]]) -> None:
        self.path = path
        self.ranges = ranges
        self.digests: list[bytes | None] = [None] * len(ranges)
        self.claimed = [False] * len(ranges)  # by the proof: a read leaves them to it
        # Read by the first shard and long enough for its units to hash: left to them at first.
        self.first = [r in first and r[1] - r[0] >= SMALL for r in ranges] if first else [False] * len(ranges)
        self.conflict = False
        self.look: Look = look_of(path)
        self.started = time.time_ns()  # after the look: a write after it moves the look


class ReadDigests:
    """The per-range digests of the files of ``ranges`` (path to its :data:`Ranges`), those no read has taken
    hashed by the proof: first every range shorter than :data:`SMALL` (no read hashes those), file by file, then
    the others in the reverse of ``order`` ((path, start, end) in the order the units read them), the ``first`` ones
    ((path, start, end): the first shard's) left to the reads until a commit needs the proof; each file's look is
    taken now, before any read. ``order`` and ``first`` matter only where :func:`hashed_in_reads`. Thread-safe:
    units call :meth:`hasher` and :meth:`took` from their threads. Raises ``OSError`` for a file that is gone."""

    def __init__(self, ranges: Mapping[str, Ranges], order: Iterable[tuple[str, int, int]] = (),
                 first: Iterable[tuple[str, int, int]] = ()) -> None:
        firsts: dict[str, set[tuple[int, int]]] = {path: set() for path in ranges}
        for path, start, end in first:
            if path in firsts:
                firsts[path].add((start, end))
        self._files = {path: _File(Path(path), spans, firsts[path]) for path, spans in ranges.items()}
        # A range is named by a slot, an int (its file's number << 32 | its index): a 90k-tensor plan's 180k ranges
        # as tuples would be objects the collector scans, on the main thread, before the first unit.
        self._numbered = list(self._files.values())
        # Only the ranges a unit may hash have a slot its read finds: a small one never does.
        self._slots = {(path, start, end): n << 32 | i for n, (path, f) in enumerate(self._files.items())
                       for i, (start, end) in enumerate(f.ranges) if end - start >= SMALL}
        small = [n << 32 | i for n, f in enumerate(self._numbered) for i, (start, end) in enumerate(f.ranges)
                 if end - start < SMALL]
        ranks: dict[tuple[str, int, int], int] = {}
        for i, read in enumerate(order if self._slots else ()):
            ranks.setdefault(read, i)
        # The proof's order ahead of the first commit: the small ranges (no read hashes them), then the ranges the
        # units read last first (unordered ones first).
        ahead = sorted((-ranks.get(key, len(ranks)), slot) for key, slot in self._slots.items()
                       if not self._numbered[slot >> 32].first[slot & _INDEX])
        self._back = small + [slot for _, slot in ahead]
        self._cursor = 0
        self._waiting = sum(sum(f.first) for f in self._files.values())  # first ranges no one has hashed yet
        self._needed = self._stopped = False
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)

    def __contains__(self, path: object) -> bool:
        return path in self._files

    @property
    def in_reads(self) -> bool:
        """Whether a unit's read may hash any range (else :meth:`hasher` answers None to every read, and a source
        need not ask it: two calls and a path lookup a read, 180k of them in a 90k-tensor run of tiny tensors)."""
        return bool(self._slots)

    def ranges(self, path: str) -> Ranges:
        """The ranges of ``path`` its digest covers."""
        return self._files[path].ranges

    def left(self, path: str) -> int:
        """The bytes of ``path``'s ranges no one has hashed or claimed yet."""
        f = self._files[path]
        with self._lock:
            return sum(end - start for (start, end), d, c in zip(f.ranges, f.digests, f.claimed) if d is None and not c)

    def settled(self, path: str) -> None:
        """The records vouch for ``path``: its reads hash nothing more, and the proof waits for none of them."""
        f = self._files[path]
        with self._turn:
            self._waiting -= sum(1 for i, first in enumerate(f.first) if first and f.digests[i] is None)
            f.first = [False] * len(f.ranges)
            f.claimed = [True] * len(f.ranges)
            self._turn.notify_all()

    def need(self) -> None:
        """A commit waits for the proof: the ranges left to the reads are hashed now."""
        with self._turn:
            self._needed = True
            self._turn.notify_all()

    def stop(self) -> None:
        """The run ends: the proof stops where it is (:class:`Abandoned`)."""
        with self._turn:
            self._stopped = True
            self._turn.notify_all()

    def hasher(self, path: str, start: int, end: int) -> xxhash.xxh3_128 | None:
        """What a unit about to read bytes ``[start, end)`` of ``path`` feeds them to as it reads them (each piece
        while it is still in the CPU's cache), then gives to :meth:`took`; None where they are no range of the file,
        or one already hashed or claimed by the proof, or one shorter than :data:`SMALL` (the proof's)."""
        if end - start < SMALL:
            return None
        slot = self._slots.get((path, start, end))
        if slot is None:
            return None
        f, i = self._numbered[slot >> 32], slot & _INDEX
        if f.digests[i] is not None or f.claimed[i]:  # read without the lock: a stale answer only hashes twice
            return None
        return xxhash.xxh3_128()

    def took(self, path: str, start: int, end: int, hashed: xxhash.xxh3_128) -> None:
        """A unit read bytes ``[start, end)`` of ``path`` into ``hashed`` (from :meth:`hasher`): its digest, unless
        the proof took it first (then both must agree)."""
        slot = self._slots[(path, start, end)]
        self._give(self._numbered[slot >> 32], (slot & _INDEX,), (hashed.digest(),))

    def _give(self, f: _File, indices: Iterable[int], digests: Iterable[bytes]) -> None:
        # A batch's digests under one plain lock (a 90k-tensor file has 18k ranges, each given alone took the lock
        # 180k times a run); the proof's threads waiting for ranges another of them hashes are woken once its batch
        # is given (_hash).
        with self._lock:
            for i, digest in zip(indices, digests):
                held = f.digests[i]
                if held is None:
                    f.digests[i] = digest
                    if f.first[i]:
                        self._waiting -= 1
                        if not self._waiting:  # the first shard's last range: the proof waits for it
                            self._turn.notify_all()
                elif held != digest:
                    f.conflict = True

    def hash_ahead(self, changed: Callable[[Path], PlanChangedError]) -> None:
        """Hash, a batch at a time, the ranges of every file the units read after the first shard and have not
        hashed, the last read first; then wait until the first shard's ranges are all hashed, or a commit needs the
        proof. Every thread of the proof calls it (none waits while another range could be hashed ahead). Raises
        ``changed(path)`` for a file that changed while it was read, :class:`Abandoned` once :meth:`stop`."""
        while True:
            with self._lock:
                if self._stopped:
                    raise Abandoned
                moved, batch = self._claim(self._back, self._cursor)
                self._cursor += moved
            if not batch:
                break
            self._hash(batch, changed)
        with self._turn:
            while not (self._needed or self._stopped or self._waiting <= 0):
                self._turn.wait()
            if self._stopped:
                raise Abandoned

    def hash_rest(self, path: Path, changed: Callable[[Path], PlanChangedError]) -> None:
        """Hash every range of ``path`` no one has hashed or claimed, a batch at a time; raises ``changed(path)`` for
        a file that changed while it was read, :class:`Abandoned` once :meth:`stop`."""
        f = self._files[str(path)]
        with self._lock:
            if self._stopped:
                raise Abandoned
            if None not in f.digests:  # all hashed ahead: the usual case, with no slot list to make
                return
        number = self._numbered.index(f) << 32
        slots = [number | i for i in range(len(f.ranges))]
        while True:
            with self._turn:
                while True:
                    if self._stopped:
                        raise Abandoned
                    _, batch = self._claim(slots, 0)
                    if batch or None not in f.digests:
                        break
                    self._turn.wait()  # ranges another thread of the proof is hashing: their digests, or their release
            if not batch:
                return
            self._hash(batch, changed)

    def _claim(self, slots: list[int], cursor: int) -> tuple[int, list[int]]:
        """Claim (lock held) up to a batch of ``slots`` from ``cursor`` that no one has hashed or claimed: how far
        the cursor moved, and the slots claimed."""
        batch: list[int] = []
        size, at, count, numbered = 0, cursor, len(slots), self._numbered
        while at < count and size < _BATCH:
            slot = slots[at]
            at += 1
            f, i = numbered[slot >> 32], slot & _INDEX
            if f.digests[i] is None and not f.claimed[i]:
                f.claimed[i] = True
                batch.append(slot)
                start, end = f.ranges[i]
                size += end - start
        return at - cursor, batch

    def _hash(self, batch: list[int], changed: Callable[[Path], PlanChangedError]) -> None:
        """Hash the claimed ``batch`` (slots), file by file, each in file order."""
        # Sorted, a file's slots lie together in its ranges' order (its number above each index): each file's are
        # cut out by bisection, where grouping them one by one cost two calls a range (180k ranges at 90k tensors).
        ordered = sorted(batch)
        by_file: dict[int, list[int]] = {}
        at = 0
        while at < len(ordered):
            number = ordered[at] >> 32
            end = bisect.bisect_left(ordered, (number + 1) << 32, at)
            by_file[number] = [slot & _INDEX for slot in ordered[at:end]]
            at = end
        try:
            for number, indices in by_file.items():
                f = self._numbered[number]
                self._give(f, indices, _range_digests(f.path, [f.ranges[i] for i in indices],
                                                      functools.partial(changed, f.path)))
                with self._turn:
                    self._turn.notify_all()  # a thread of the proof may wait for these ranges (hash_rest)
        except BaseException:
            with self._turn:  # released: a thread waiting for them hashes them itself (and says what it finds)
                for slot in batch:
                    f, i = self._numbered[slot >> 32], slot & _INDEX
                    if f.digests[i] is None:
                        f.claimed[i] = False
                self._turn.notify_all()
            raise

    def digest(self, path: Path, changed: Callable[[], PlanChangedError]) -> tuple[Look, int, str]:
        """``path``'s look before its first read (ctime -1 where written within a timestamp tick of it, a later
        write could keep the look, or where its ctime moved since), when that was (ns) and its digest (hex), once
        every range is hashed (:meth:`hash_rest` ended); raises ``changed()`` where the file changed while it was
        read (:func:`~resumerge.inputs.looks.check_read`: where only its ctime moved, every range is hashed again
        and must agree)."""
        f = self._files[str(path)]
        with self._lock:
            digests, conflict = list(f.digests), f.conflict
        if conflict or None in digests:
            raise changed()

        def agrees_again() -> bool:  # only the ctime moved: every range hashed again must agree (issue 97)
            return _range_digests(path, f.ranges, changed) == digests

        moved = looks.check_read(path, f.look, agrees_again, changed)
        size, mtime, ctime, inode = f.look
        racy = moved or max(mtime, ctime) + looks.RACY_WINDOW_NS >= f.started  # looked up now: a test sets it
        return (size, mtime, -1 if racy else ctime, inode), f.started, combined(cast("list[bytes]", digests))


def _range_digests(path: Path, ranges: Sequence[tuple[int, int]], changed: Callable[[], PlanChangedError]
                   ) -> list[bytes]:
    """The xxh3-128 digest of each of ``ranges`` of ``path`` (sorted): those shorter than :data:`SMALL` read
    together (:func:`_small_digests`), each longer one alone. Raises ``changed()`` for a file that changed while it
    was read."""
    found = [b""] * len(ranges)
    small = [i for i, (start, end) in enumerate(ranges) if end - start < SMALL]
    if small:
        for i, digest in zip(small, _small_digests(path, [ranges[i] for i in small], changed)):
            found[i] = digest
    large = [i for i, (start, end) in enumerate(ranges) if end - start >= SMALL]
    if large:
        hashers = [xxhash.xxh3_128() for _ in large]
        hash_spans(path, [((ranges[i],), h) for i, h in zip(large, hashers)], changed)
        for i, h in zip(large, hashers):
            found[i] = h.digest()
    return found


def _small_digests(path: Path, ranges: list[tuple[int, int]], changed: Callable[[], PlanChangedError]) -> list[bytes]:
    """The xxh3-128 digest of each of ``ranges`` of ``path`` (sorted, each shorter than :data:`SMALL`): those within
    :data:`_GAP` of each other read together (up to :data:`_BLOCK` at once), each hashed from the buffer in one
    call. Raises ``changed()`` for a file that changed while it was read (its look, or a range past its end)."""
    before = look_of(path)
    found = _small_read(path, ranges, changed)
    looks.check_read(path, before, lambda: _small_read(path, ranges, changed) == found, changed)
    return found


def _small_read(path: Path, ranges: list[tuple[int, int]], changed: Callable[[], PlanChangedError]) -> list[bytes]:
    """:func:`_small_digests`' digests as read, the file's look not checked."""
    view = memoryview(bytearray())  # grown to the longest run read (at most _BLOCK): a few isolated ranges, small
    digest = xxhash.xxh3_128_digest
    found = [b""] * len(ranges)  # each set in place: no append call per range
    fd = os.open(path, os.O_RDONLY)
    try:
        at = held = 0  # the buffer holds bytes [at, at + held) of the file
        n = len(ranges)
        for k, (start, end) in enumerate(ranges):
            if start < at or end > at + held:
                # Read from this range to the end of the last one close enough after it (within one buffer).
                last = end
                j = k + 1
                while j < n:
                    after, upto = ranges[j]
                    if after - last > _GAP or upto - start > _BLOCK:
                        break
                    if upto > last:
                        last = upto
                    j += 1
                at, held = start, 0
                if len(view) < last - start:
                    view = memoryview(bytearray(last - start))
                while held < last - start:
                    got = os.preadv(fd, [view[held:last - start]], start + held)
                    if got <= 0:
                        raise changed()
                    held += got
            found[k] = digest(view[start - at:end - at])
    finally:
        os.close(fd)
    return found

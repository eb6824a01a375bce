"""How a file looks to the cheap gate of a content proof (size, mtime, ctime, inode), what tells that its content
moved while it was read (:func:`check_read`: never its ctime alone), and the xxh3-128 of groups of its byte ranges
(:mod:`resumerge.forward.job.proof`: a pass's models, a digest per decoder layer).

Kept apart from :mod:`.contents` (a merge's proof, whose records share the hub's verification database): a check
imports this, and its start is paid again by every check, so nothing of the hub's stack is imported here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import xxhash

from resumerge.errors import PlanChangedError

# Coarse file timestamps (ext4 ticks, NFS, FAT's 2 s) make a write within this window of a hash ambiguous (the
# same window as the hub's verification records: resumerge.inputs.hub.records).
RACY_WINDOW_NS = 2_000_000_000
_BLOCK = 8 * 1024 * 1024
# The [start, end) byte ranges of a file, sorted and merged.
Spans = Sequence[tuple[int, int]]


# How a file looks to the cheap gate that decides whether its digests must be taken again: size, mtime, ctime and
# inode (a rewrite in place moves the first three, a replacement the inode; user space cannot set ctime back).
Look = tuple[int, int, int, int]


def look_of(path: Path) -> Look:
    """``path``'s :data:`Look` now (raises ``OSError`` where it is gone)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def same_content(before: Look, after: Look) -> bool:
    """Whether ``after`` shows the content ``before`` did by its witnesses: size, mtime and inode. The ctime is no
    witness: a chmod, a chown, a new hard link or an xattr moves it and leaves the bytes as they were (issue 97)."""
    return (before[0], before[1], before[3]) == (after[0], after[1], after[3])


def check_read(path: Path, before: Look, agrees_again: Callable[[], bool],
               changed: Callable[[], PlanChangedError]) -> bool:
    """After a read of ``path``, which looked ``before`` when the read began: whether only its ctime moved meanwhile
    (then what was read was read again and agreed, ``agrees_again()``; the look taken is not to be trusted). Raises
    ``changed()`` where its content's witnesses moved, or the second read found other bytes (a write whose mtime was
    set back shows only in the ctime)."""
    try:
        after = look_of(path)
        if after == before:
            return False
        if same_content(before, after) and agrees_again() and same_content(before, look_of(path)):
            return True
    except FileNotFoundError:
        pass
    raise changed()


class Digest(Protocol):
    """What a hash object offers to :func:`hash_spans` (xxhash's and hashlib's alike)."""

    def update(self, data: memoryview, /) -> None: ...

    def copy(self) -> Digest: ...

    def digest(self) -> bytes: ...


def hash_spans(path: Path, groups: Iterable[tuple[Spans, Digest]],
               changed: Callable[[], PlanChangedError]) -> tuple[Look, bool]:
    """Feed each group's spans of ``path`` to its digest, and return how the file looked while read and whether its
    look is not to be trusted: written within a timestamp tick of the read (racy: a later write could keep the same
    look: git's "racy clean"), or its ctime moved while it was read (the spans were hashed again and agreed). Read
    by ``preadv`` into one buffer (8 MiB, or its largest span where smaller), not mapped: a map's pages would count
    in the process's RSS, which the RAM governor watches; one buffer, so its pages are faulted in and zeroed once,
    not at every read. Raises
    ``changed()`` for a file that changed while it was read (:func:`check_read`)."""
    listed = list(groups)
    spare = [(spans, digest.copy()) for spans, digest in listed]  # as handed in: fed again where only ctime moves
    before = look_of(path)
    started = time.time_ns()
    # no larger than its largest span: the proof's threads hash a run's last ranges beside its last units, and a
    # small file's 8 MiB each were what a run at its smallest budget peaked over it by
    block = bytearray(min(_BLOCK, max((end - start for spans, _ in listed for start, end in spans), default=1)))
    _feed(path, listed, memoryview(block), changed)

    def agrees_again() -> bool:
        _feed(path, spare, memoryview(block), changed)
        return all(a.digest() == b.digest() for (_, a), (_, b) in zip(listed, spare))

    if check_read(path, before, agrees_again, changed):
        return before, True
    return before, max(before[1], before[2]) + RACY_WINDOW_NS >= started


def _feed(path: Path, groups: Iterable[tuple[Spans, Digest]], view: memoryview,
          changed: Callable[[], PlanChangedError]) -> None:
    """Feed each group's spans of ``path`` to its digest, read through ``view``; ``changed()`` where one ends past
    the file's end."""
    size = len(view)
    fd = os.open(path, os.O_RDONLY)
    try:
        for spans, digest in groups:
            for start, end in spans:
                at = start
                while at < end:
                    n = os.preadv(fd, [view[:min(size, end - at)]], at)
                    if n <= 0:
                        raise changed()
                    digest.update(view[:n])
                    at += n
    finally:
        os.close(fd)


def group_digests(path: Path, groups: Mapping[int, Spans]) -> tuple[Look, dict[int, str]]:
    """The xxh3-128 of each group of ranges of ``path`` (``groups``: a key, e.g. the decoder layer whose tensors
    they are, to its spans), and how the file looked while hashed; a file written within a timestamp tick of the
    hash gets a look no later stat matches (ctime -1: hashed again next time). Raises :class:`PlanChangedError`
    for a file that changed while it was read."""
    digests = {key: xxhash.xxh3_128() for key in groups}
    look, racy = hash_spans(path, ((spans, digests[key]) for key, spans in groups.items()), lambda: _changed(path))
    return (look[0], look[1], -1 if racy else look[2], look[3]), {k: d.hexdigest() for k, d in digests.items()}


def _changed(path: Path) -> PlanChangedError:
    return PlanChangedError(f"input file {path} changed while it was being read; nothing was kept from it",
                            path=str(path), hint="run the same command again once the file is final")

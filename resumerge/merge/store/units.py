"""A file written in place, unit by unit (a GGUF output, whose every byte's place the plan fixes): where it lies
until it is complete, and the checksums of its units.

The file is made under a name of its own beside its final one (``.model.gguf.units.part``, not a random temp name:
the next run finds it again), created by resumerge with its planned size, and each unit (the header, then groups of
consecutive tensors) is written at its offsets, fsynced, and journaled with the checksum of its byte range
(:class:`~resumerge.merge.store.unitwriter.UnitFileWriter`; the run's algorithm,
:mod:`resumerge.machine.checksums`). A resume keeps a unit only when its bytes in that file still hash to the
recorded checksum (:func:`check_units`); once every unit is in, the file is renamed to its final name and committed
whole, like any other. A sink that commits a file whole (a hub repo, a staged copy to Drive) has no such file: its units
are never journaled and an interruption loses the file being written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from resumerge.machine.checksums import Checksum, checksum_of

UNITS_SUFFIX = ".units.part"
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Unit:
    """One unit of a file written in place: its index (0: the header), byte range and output tensors."""

    index: int
    start: int
    end: int
    tensors: tuple[str, ...] = ()


def partial_name(name: str) -> str:
    """The name the in-place file of planned output file ``name`` has until it is complete."""
    return f".{name}{UNITS_SUFFIX}"


def is_partial_name(name: str, planned: Iterable[str]) -> bool:
    """True when ``name`` is the in-place file of one of the ``planned`` output files."""
    return name.startswith(".") and name.endswith(UNITS_SUFFIX) and name[1:-len(UNITS_SUFFIX)] in set(planned)


def hash_range(fd: int, start: int, end: int, checksum: Checksum,
               feed: Callable[[memoryview], object] | None = None, pool: Executor | None = None) -> str:
    """The record of the ``checksum`` digest of bytes ``start``..``end`` of the open file ``fd``, each block read
    also given to ``feed`` (on ``pool``'s thread while this one hashes it: both release the GIL); raises
    ``EOFError`` when the file ends first."""
    digest = checksum.new()
    buffer = memoryview(bytearray(min(_BLOCK, max(1, end - start))))
    at = start
    while at < end:
        want = buffer[:min(len(buffer), end - at)]
        got = os.preadv(fd, [want], at)
        if not got:
            raise EOFError(f"the file ends at byte {at}, before {end}")
        block = want[:got]
        fed = pool.submit(feed, block) if feed is not None and pool is not None else None
        digest.update(block)
        if fed is not None:
            fed.result()  # before the buffer is read into again
        elif feed is not None:
            feed(block)
        at += got
    return checksum.record(digest.hexdigest())


def check_units(path: Path, units: Iterable[tuple[int, int, int, str]]) -> Mapping[int, str | None]:
    """For each committed unit ``(index, start, end, recorded checksum)`` of the in-place file ``path``: why it can
    no longer be trusted, or None when its bytes still hash to its record (by the algorithm it names)."""
    units = list(units)
    if not units:
        return {}
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        why = "missing" if isinstance(exc, FileNotFoundError) else f"unreadable ({exc.strerror})"
        return {index: why for index, *_ in units}
    problems: dict[int, str | None] = {}
    try:
        for index, start, end, sha in units:
            checksum = checksum_of(sha)
            if checksum is None:
                problems[index] = f"unit {index} (bytes {start}-{end}) has a recorded checksum of no known kind"
                continue
            try:
                problems[index] = None if hash_range(fd, start, end, checksum) == sha else \
                    f"unit {index} (bytes {start}-{end}) differs from its recorded checksum"
            except EOFError:
                problems[index] = f"unit {index} (bytes {start}-{end}) is cut short"
    finally:
        os.close(fd)
    return problems

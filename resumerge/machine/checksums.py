"""Checksums of output files: what decides whether a committed file can still be trusted.

A recorded checksum names its algorithm (:func:`checksum_of`): ``xxh3-128:HEX`` (32 hex digits), or 64 hex digits
alone, a sha256, the only kind recorded before issue 87 — so a ledger row, a unit row and a manifest entry written
by an earlier version verify as they were recorded, and their columns and keys keep the name ``sha256``.

A run records every file and unit it commits with one algorithm: the one its ledger's records already use (a run
continued, or rebuilt from OUT's manifest, keeps its kind, so its records never mix), else its sink's
(:attr:`~resumerge.merge.store.sink.OutputSink.checksum`; :class:`~resumerge.merge.store.journal_commit.CommitJournal`
decides). A folder's is xxh3-128: sha256 was the largest CPU cost of a linear merge, and xxh3-128 hashes several
times as fast a core, more so on a CPU without SHA instructions (``python bench/bench_checksums.py`` measures both).
A hub repo's is sha256, which names its LFS objects: hashed once as the file is written, it is the upload's oid and
the record.

xxh3-128 catches what the commit protocol guards against (a file torn, cut short, altered or swapped: two different
contents share a digest with odds of 2^-128), not a collision built on purpose, as the inputs' content proof
(:mod:`resumerge.inputs.contents`) says of its own.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

import xxhash

from resumerge.errors import ResumergeError

_BLOCK = 8 * 1024 * 1024


class Hasher(Protocol):
    """A running digest: hashlib's and xxhash's objects alike."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class Checksum:
    """One algorithm output files are recorded with: ``name`` as records carry it, and how to start a digest."""

    name: str
    make: Callable[[], Hasher]
    digits: int  # hex digits of a digest

    def new(self) -> Hasher:
        """A fresh running digest."""
        return self.make()

    def record(self, hexdigest: str) -> str:
        """What the ledger and the manifest record of a digest: a sha256 bare (as every record before), any other
        prefixed with its name."""
        return hexdigest if self.name == _BARE else f"{self.name}:{hexdigest}"

    def of(self, data: bytes | memoryview) -> str:
        """The record of ``data``'s digest."""
        digest = self.new()
        digest.update(data)
        return self.record(digest.hexdigest())

    def placeholder(self) -> str:
        """A record of this algorithm's length (a manifest's size is known before any file is hashed)."""
        return self.record("0" * self.digits)


_BARE = "sha256"  # the one algorithm recorded without its name: every record before names were
SHA256 = Checksum(_BARE, hashlib.sha256, 64)
XXH3_128 = Checksum("xxh3-128", xxhash.xxh3_128, 32)
_TAGGED = MappingProxyType({c.name: c for c in (XXH3_128,)})


def checksum_of(recorded: str) -> Checksum | None:
    """The algorithm of the record ``recorded``: 64 hex digits alone are a sha256, ``NAME:HEX`` names its own; None
    for one this resumerge does not know (nothing it can check)."""
    name, sep, digest = recorded.partition(":")
    if not sep:
        return SHA256 if len(recorded) == SHA256.digits else None
    found = _TAGGED.get(name)
    return found if found is not None and len(digest) == found.digits else None


def written_with(recorded: str) -> Checksum:
    """The algorithm of ``recorded``, a record this process made of bytes it wrote (a writer's, handed to a sink):
    one of no known kind is a defect, never a user's doing."""
    checksum = checksum_of(recorded)
    if checksum is None:
        raise ResumergeError(f"internal: the checksum {recorded!r} names no algorithm resumerge knows")
    return checksum


def matches(data: bytes, recorded: str) -> bool:
    """Whether ``data`` hashes to the record ``recorded`` (by the algorithm it names)."""
    checksum = checksum_of(recorded)
    return checksum is not None and checksum.of(data) == recorded


def hash_file(path: Path, checksum: Checksum = SHA256) -> tuple[int, str]:
    """(size, record of the ``checksum`` digest) of the file at ``path``, read in 8 MiB blocks."""
    digest = checksum.new()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return size, checksum.record(digest.hexdigest())


def check_committed(out_dir: Path, name: str, size: int, recorded: str) -> str | None:
    """Why the committed file ``name`` can no longer be trusted, or None when its bytes are intact (they hash to
    ``recorded`` by the algorithm it names)."""
    path = out_dir / name
    if not path.is_file():
        return "missing"
    actual = path.stat().st_size
    if actual != size:
        return f"size {actual} differs from the committed {size} bytes"
    checksum = checksum_of(recorded)
    if checksum is None:
        return "its recorded checksum is of no kind this resumerge knows"
    if hash_file(path, checksum)[1] != recorded:
        return "contents differ from the committed checksum"
    return None


def check_many(
    out_dir: Path, files: Iterable[tuple[str, int, str]], workers: int | None = None
) -> Mapping[str, str | None]:
    """:func:`check_committed` for each ``(name, size, recorded checksum)``, hashing files in parallel.

    hashlib, xxhash and unbuffered reads release the GIL on large blocks, so threads use every core (a finished
    1.7 GB merge re-verifies by sha256 in about half the time on two). Returns name -> problem (None when intact).
    """
    items = list(files)
    count = workers or min(len(items), os.cpu_count() or 1, 8)
    if count <= 1:
        return {name: check_committed(out_dir, name, size, sha) for name, size, sha in items}
    # Largest first, so one big file does not start last and leave the other threads idle.
    items.sort(key=lambda item: -item[1])
    from concurrent.futures import ThreadPoolExecutor  # here: only verifying hashes files on threads

    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="resumerge-verify") as pool:
        problems = pool.map(lambda item: check_committed(out_dir, *item), items)
        return {item[0]: problem for item, problem in zip(items, problems)}

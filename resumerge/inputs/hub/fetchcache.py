"""A machine's fetch cache of streamed hub ranges: bytes fetched once are read again from local disk, not the hub.

A cluster node streams its shards' hub inputs itself (:mod:`resumerge.merge.engine.cluster.hubreads`); what it fetched
it keeps in a folder of its own disk (:class:`FetchCache`), one file per fetched piece, named by its byte span, so
that a later read of any of those bytes (a tensor read twice, a row range of one read already, the read-ahead of
one worker that another worker of the node then needs, a resumed run's shards on the same node) costs a local
read, and only the bytes no piece holds are fetched (:class:`CachedRanges`). The worker processes of a node share
the folder: a piece is written under a temporary name and renamed, so a reader sees it whole or not at all; each
process learns the pieces there when it opens a file's folder, and its own as it fetches them.

The cache holds at most ``limit`` bytes of the pieces a process wrote, evicting its oldest first (then a later read
of them is fetched again). Bytes read from it are checked as fetched ones are: the caller's range check (the
run's ledger digests) sees every range whatever its origin.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from collections import deque
from pathlib import Path

from resumerge.inputs.hub.ranges import RangeClient

_TEMP = ".part-"


def private_root(name: str) -> Path:
    """The folder of the node's fetch cache called ``name``: under ``resumerge-fetch-UID`` in the temp folder, made
    so that only this user may enter it (0700). Pieces there are trusted as fetched bytes and hold bytes of private
    repos, so a folder another user owns, or may enter, is never used: then a fresh private folder of this process's
    own serves instead (its pieces are not shared with the node's other workers)."""
    base = Path(tempfile.gettempdir())
    uid = os.getuid() if hasattr(os, "getuid") else None
    folder = base / f"resumerge-fetch-{uid if uid is not None else 'user'}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = os.lstat(folder)
        if stat.S_ISDIR(found.st_mode) and (uid is None or found.st_uid == uid) and not found.st_mode & 0o077:
            return folder / name
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="resumerge-fetch-")) / name


class FetchCache:
    """The fetch cache in ``root`` (made when first written to), holding at most ``limit`` bytes of this process's
    pieces (0: nothing is kept)."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root, self.limit = root, max(0, limit)
        self._lock = threading.Lock()
        self._held = 0
        self._written: deque[tuple[Path, int]] = deque()  # this process's pieces, oldest first, with their sizes

    def reader(self, client: RangeClient) -> CachedRanges:
        """``client``'s file read through this cache."""
        key = hashlib.sha256(f"{client.repo_id}@{client.commit}/{client.filename}".encode()).hexdigest()[:24]
        return CachedRanges(client, self, self.root / key)

    def kept(self, piece: Path, size: int) -> None:
        """Count a piece just written; evict this process's oldest pieces past the limit."""
        with self._lock:
            self._written.append((piece, size))
            self._held += size
            while self._held > self.limit and self._written:
                old, old_size = self._written.popleft()
                old.unlink(missing_ok=True)
                self._held -= old_size

    def clear(self) -> None:
        """Delete the whole cache (the run it served is over)."""
        shutil.rmtree(self.root, ignore_errors=True)
        with self._lock:
            self._written.clear()
            self._held = 0


class CachedRanges:
    """One hub file's ranges through the cache: :meth:`read` as :meth:`RangeClient.read` does, fetching only the
    bytes no cached piece holds. Thread-safe."""

    def __init__(self, client: RangeClient, cache: FetchCache, folder: Path) -> None:
        self.client, self.cache, self.folder = client, cache, folder
        self.size = client.size
        self._lock = threading.Lock()
        self._pieces: dict[tuple[int, int], Path] | None = None  # span -> piece file, listed on first use

    def read(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of the file: cached pieces read locally, the gaps between them fetched (and kept).
        Raises what :meth:`RangeClient.read` raises."""
        data = bytearray()
        at = start
        for (first, last), path in self._covering(start, end):
            if last <= at:
                continue
            if first > at:
                data += self._fetch(at, first)
                at = first
            piece = self._load(path, at - first, min(last, end) - first)
            if piece is None:  # evicted meanwhile (by another process of the node): fetched again
                continue
            data += piece
            at = min(last, end)
        if at < end:
            data += self._fetch(at, end)
        return data

    def _covering(self, start: int, end: int) -> list[tuple[tuple[int, int], Path]]:
        """The known pieces that overlap ``[start, end)``, by start."""
        with self._lock:
            if self._pieces is None:
                self._pieces = _listed(self.folder)
            found = [(span, path) for span, path in self._pieces.items() if span[0] < end and span[1] > start]
        return sorted(found)

    def _load(self, path: Path, start: int, end: int) -> bytearray | None:
        try:
            with path.open("rb") as file:
                file.seek(start)
                data = bytearray(file.read(end - start))
        except FileNotFoundError:
            data = None
        if data is None or len(data) != end - start:
            with self._lock:
                if self._pieces is not None:
                    self._pieces = {span: p for span, p in self._pieces.items() if p != path}
            return None
        return data

    def _fetch(self, start: int, end: int) -> bytearray:
        """Fetch ``[start, end)`` from the hub and keep it as a piece (unless the cache keeps nothing)."""
        data = self.client.read(start, end)
        if self.cache.limit < end - start:
            return data
        path = self.folder / f"{start}-{end}"
        temp = self.folder / f"{_TEMP}{os.getpid()}-{threading.get_ident()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            temp.write_bytes(data)
            os.replace(temp, path)
        except OSError:
            # Keeping is only a saving: the folder deleted by another worker of the node as its pipeline ended, or
            # a full disk, must not fail a read whose bytes are already here (and checked by the caller).
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            return data
        with self._lock:
            if self._pieces is not None:
                self._pieces[(start, end)] = path
        self.cache.kept(path, end - start)
        return data


def _listed(folder: Path) -> dict[tuple[int, int], Path]:
    """The pieces in ``folder`` (written by this node's other processes, or a run before), by span."""
    pieces = {}
    if folder.is_dir():
        for path in folder.iterdir():
            first, dash, last = path.name.partition("-")
            if dash and first.isdigit() and last.isdigit() and int(first) < int(last):
                pieces[(int(first), int(last))] = path
    return pieces

"""Verification records: which cached blob was hashed, when, and what it looked like then.

A small SQLite file in the resumerge state directory (never in the output directory, never in the hub cache),
keyed by the blob's real path. A record is trusted, and the blob not hashed again, only while its size and
mtime are unchanged *and* the blob was last modified clearly before it was hashed: a write landing within the
file system's timestamp granularity of the hash would otherwise keep the old mtime and go unnoticed (git's
"racy clean" problem). Records of untrusted blobs are simply refreshed by the next hash.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from resumerge.config.closing import Closing
from resumerge.inputs.looks import RACY_WINDOW_NS as RACY_WINDOW_NS  # one window for every record of a look

DB_NAME = "hub-verified.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS verified (
    path TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    algorithm TEXT NOT NULL,
    digest TEXT NOT NULL,
    verified_at_ns INTEGER NOT NULL
)
"""


class VerifyRecords(Closing):
    """Open (creating if needed) the records in ``directory``; ``None`` keeps them in memory for one call.

    Use as a context manager or call :meth:`close`. Raises ``sqlite3.Error`` / ``OSError`` only if the state
    directory itself is unusable.
    """

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        if directory is None:
            target = ":memory:"
        else:
            Path(directory).mkdir(parents=True, exist_ok=True)
            target = os.fspath(Path(directory) / DB_NAME)
        self._db = sqlite3.connect(target, timeout=30)
        with self._db:
            self._db.execute(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    def trusted(self, path: Path, algorithm: str, digest: str) -> bool:
        """Return whether ``path`` was verified to hash to ``digest`` and has not changed since.

        ``path`` must be the blob's real path. Returns ``False`` for a missing file or record.
        """
        return self._recorded(path, algorithm, None) == digest

    def digest_of(self, path: Path, algorithm: str, *, newer_than: int) -> str | None:
        """The digest recorded for ``path`` (its real path) in ``algorithm`` while its size and mtime are unchanged
        and it was hashed clearly after ``newer_than`` (ns: the caller's last moment the file could have been
        written, such as its ctime); else None. What a local input's content proof reuses instead of hashing."""
        return self._recorded(path, algorithm, newer_than)

    def _recorded(self, path: Path, algorithm: str, newer_than: int | None) -> str | None:
        """The digest recorded for ``path`` in ``algorithm`` while its size and mtime are unchanged and it was
        hashed clearly (:data:`RACY_WINDOW_NS`) after its mtime and ``newer_than`` (None: its mtime alone); else
        None (no file, no record)."""
        try:
            st = path.stat()
        except OSError:
            return None
        row = self._db.execute(
            "SELECT size, mtime_ns, algorithm, digest, verified_at_ns FROM verified WHERE path = ?",
            (os.fspath(path),),
        ).fetchone()
        if row is None:
            return None
        size, mtime_ns, algo, recorded, verified_at_ns = row
        written = st.st_mtime_ns if newer_than is None else max(newer_than, st.st_mtime_ns)
        fresh = written + RACY_WINDOW_NS < verified_at_ns
        return str(recorded) if (size, mtime_ns, algo) == (st.st_size, st.st_mtime_ns, algorithm) and fresh else None

    def record(self, path: Path, algorithm: str, digest: str, verified_at_ns: int) -> None:
        """Record that ``path`` hashed to ``digest``.

        ``verified_at_ns`` is a ``time.time_ns()`` taken when the hashed content was already final (before the
        first read when hashing a file). The stat is taken now; a change during hashing shows as an mtime after
        ``verified_at_ns`` and leaves the record untrusted.
        """
        st = path.stat()
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO verified VALUES (?, ?, ?, ?, ?, ?)",
                (os.fspath(path), st.st_size, st.st_mtime_ns, algorithm, digest, verified_at_ns),
            )

    def forget(self, path: Path) -> None:
        """Drop the record of ``path`` (it failed verification or is being replaced)."""
        with self._db:
            self._db.execute("DELETE FROM verified WHERE path = ?", (os.fspath(path),))


def now_ns() -> int:
    """Wall-clock nanoseconds, the clock file mtimes are compared with."""
    return time.time_ns()

"""Check cached files against the hub's own checksums, hashing each blob only when its record is stale.

huggingface_hub checks only the size of what it downloads and nothing at all on a cache hit, so a flipped bit
or a truncated blob would otherwise be merged silently. The checksum is the blob's name: sha256 for LFS files,
the git blob sha1 (``sha1(b"blob <size>\\0" + content)``) for small ones.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

from resumerge.inputs.hub.cache import RemoteFile
from resumerge.inputs.hub.events import ByteMeter, ProgressCallback
from resumerge.inputs.hub.records import VerifyRecords, now_ns

_CHUNK = 8 * 1024 * 1024
# Below this size a file hashes in well under a second, so no progress events are worth sending.
_QUIET_BELOW = 64 * 1024 * 1024


class Hasher(Protocol):
    """The part of ``hashlib`` objects used here."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(remote: RemoteFile, size: int) -> Hasher:
    """Return a fresh hasher for ``remote``'s checksum of content that is ``size`` bytes long."""
    if remote.sha256:
        return hashlib.sha256()
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % size)  # git hashes a header with the content length before the content
    return h


def hash_file(path: Path, remote: RemoteFile, meter: ByteMeter | None = None) -> str:
    """Return the hex checksum of the file at ``path`` in ``remote``'s algorithm. Raises ``OSError``."""
    with path.open("rb") as f:
        h = new_hasher(remote, path.stat().st_size)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if meter is not None:
                meter.add(len(chunk))
    return h.hexdigest()


def check_cached(
    local: Path, remote: RemoteFile, records: VerifyRecords, repo_id: str, emit: ProgressCallback
) -> str | None:
    """Check the cached file ``local`` (a snapshot entry) against ``remote``'s checksum and size.

    Returns ``None`` when it is intact (recording the verification), else a short reason: ``"missing"``,
    ``"N bytes, expected M"`` or ``"sha256 mismatch"``. The blob is hashed only when no trusted record covers
    it, so a resume re-reads nothing that was verified before. Never raises for a damaged file; ``OSError``
    only for an unreadable one.
    """
    if not local.exists():
        return "missing"
    real = local.resolve()
    size = real.stat().st_size
    if remote.size is not None and size != remote.size:
        records.forget(real)
        return f"{size} bytes, expected {remote.size}"
    if records.trusted(real, remote.algorithm, remote.etag):
        return None
    started = now_ns()
    meter = None
    if size >= _QUIET_BELOW:
        meter = ByteMeter(emit, "verify", repo_id, remote.path, total=size)
    digest = hash_file(real, remote, meter)
    if meter is not None:
        meter.finish()
    if digest != remote.etag:
        records.forget(real)
        return f"{remote.algorithm} mismatch"
    records.record(real, remote.algorithm, digest, started)
    return None

"""Checksums of output files: the sha256 that decides whether a committed file can still be trusted."""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 8 * 1024 * 1024


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of the file at ``path``, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def check_committed(out_dir: Path, name: str, size: int, sha256: str) -> str | None:
    """Why the committed file ``name`` can no longer be trusted, or None when its bytes are intact."""
    path = out_dir / name
    if not path.is_file():
        return "missing"
    actual = path.stat().st_size
    if actual != size:
        return f"size {actual} differs from the committed {size} bytes"
    if hash_file(path)[1] != sha256:
        return "contents differ from the committed checksum"
    return None

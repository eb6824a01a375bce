"""Checksums of output files: the sha256 that decides whether a committed file can still be trusted."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
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


def check_many(
    out_dir: Path, files: Iterable[tuple[str, int, str]], workers: int | None = None
) -> Mapping[str, str | None]:
    """:func:`check_committed` for each ``(name, size, sha256)``, hashing files in parallel.

    hashlib and unbuffered reads release the GIL on large blocks, so threads use every core (a finished
    1.7 GB merge re-verifies in about half the time on two). Returns name -> problem (None when intact).
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

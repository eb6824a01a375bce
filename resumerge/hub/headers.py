"""safetensors headers, read from a cached file or with two HTTP Range requests before any weight is fetched.

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON mapping tensor
names to ``{dtype, shape, data_offsets}`` (offsets into the data that follows), plus an optional
``__metadata__`` of strings. That is all shape and name validation needs, so a config mistake is found after
reading kilobytes instead of gigabytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from resumerge.errors import HostileFileError, ModelInputError
from resumerge.hub.cache import HubSettings, RemoteFile
from resumerge.hub.remote import read_range

# safetensors itself refuses headers above 100 MB; a larger length is a corrupt or hostile file.
MAX_HEADER_BYTES = 100_000_000


def header_length(first8: bytes, file_size: int | None, where: str) -> int:
    """Return the JSON header length stated by the first 8 bytes of a safetensors file.

    Raises :class:`HostileFileError` if it is absurd or runs past ``file_size``.
    """
    if len(first8) != 8:
        raise ModelInputError(f"{where} is too short to be a safetensors file")
    n = int.from_bytes(first8, "little")
    if n < 2 or n > MAX_HEADER_BYTES or (file_size is not None and 8 + n > file_size):
        raise HostileFileError(
            f"{where} claims a {n}-byte safetensors header"
            + (f" in a {file_size}-byte file" if file_size is not None else ""),
            hint="the file is corrupt or not a safetensors file; it was not read further",
        )
    return n


def parse_header(raw: bytes, file_size: int | None, where: str) -> dict[str, Any]:
    """Parse header JSON ``raw`` and check that every tensor's data lies inside the file.

    Returns the header as a dict (``__metadata__`` included). Raises :class:`ModelInputError` for text that is
    not a safetensors header, :class:`HostileFileError` for offsets or shapes that lie about sizes.
    """
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelInputError(f"{where} does not start with a safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ModelInputError(f"{where} does not start with a safetensors header (not a JSON object)")
    data_size = None if file_size is None else file_size - 8 - len(raw)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not _well_formed(info):
            raise ModelInputError(f"{where}: malformed header entry for tensor {name!r}", tensor=name)
        begin, end = info["data_offsets"]
        if begin > end or (data_size is not None and end > data_size):
            raise HostileFileError(
                f"{where}: tensor {name!r} claims bytes {begin}..{end} of a {data_size}-byte data section",
                tensor=name,
            )
    return header


def read_local_header(path: Path, where: str) -> dict[str, Any]:
    """Read and parse the header of the safetensors file at ``path``. Raises as :func:`parse_header`."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = header_length(f.read(8), size, where)
        return parse_header(f.read(n), size, where)


def read_remote_header(settings: HubSettings, repo_id: str, commit: str, remote: RemoteFile) -> dict[str, Any]:
    """Fetch and parse the header of ``remote`` with two Range requests: 8 bytes, then exactly the header."""
    where = f"{repo_id}@{commit[:12]}/{remote.path}"
    n = header_length(read_range(settings, repo_id, commit, remote.path, 0, 8), remote.size, where)
    return parse_header(read_range(settings, repo_id, commit, remote.path, 8, n), remote.size, where)


def _well_formed(info: object) -> bool:
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")
    return (
        isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
    )

"""safetensors headers, read from a cached file or with two HTTP Range requests before any weight is fetched.

A safetensors file starts with an 8-byte little-endian header length N, then N bytes of JSON mapping tensor
names to ``{dtype, shape, data_offsets}`` (offsets into the data that follows), plus an optional
``__metadata__`` of strings. That is all shape and name validation needs, so a config mistake is found after
reading kilobytes instead of gigabytes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from resumerge.errors import HostileFileError, ModelInputError
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache
from resumerge.inputs.hub.fetch import offline_error
from resumerge.inputs.hub.ranges import RangeClient
from resumerge.inputs.hub.remote import HubUnavailableError, is_network_error, read_range
from resumerge.inputs.safetensors_format import Header
from resumerge.inputs.safetensors_format import parse_header as strict_parse_header

# safetensors itself refuses headers above 100 MB; a larger length is a corrupt or hostile file.
MAX_HEADER_BYTES = 100_000_000
_THREADS = 8  # header reads are latency-bound: a few in flight hide the round trips


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


def parse_header(raw: bytes, file_size: int | None, where: str) -> Header:
    """Parse header bytes ``raw`` of a ``file_size``-byte file with resumerge's strict safetensors parser.

    Raises :class:`ModelInputError` when the size is unknown, :class:`HostileFileError` (from
    :func:`resumerge.inputs.safetensors_format.parse_header`) for text that is not a header or offsets that lie.
    """
    if file_size is None:
        raise ModelInputError(f"{where}: the file size is unknown, so its header cannot be checked")
    return strict_parse_header(raw, file_size=file_size, path=where)


def read_local_header(path: Path, where: str) -> Header:
    """Read and parse the header of the safetensors file at ``path``. Raises as :func:`parse_header`."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = header_length(f.read(8), size, where)
        return parse_header(f.read(n), size, where)


def read_remote_header(settings: HubSettings, repo_id: str, commit: str, remote: RemoteFile) -> Header:
    """Fetch and parse the header of ``remote`` with two Range requests: 8 bytes, then exactly the header."""
    where = f"{repo_id}@{commit[:12]}/{remote.path}"
    if remote.size is None or remote.size < 8:
        n = header_length(read_range(settings, repo_id, commit, remote.path, 0, 8), remote.size, where)
        return parse_header(read_range(settings, repo_id, commit, remote.path, 8, n), remote.size, where)
    # The range client that streams tensors: signed-URL reuse, Retry-After, resumed cuts, Range-ignoring servers.
    client = RangeClient(settings, repo_id, commit, remote.path, remote.size)
    n = header_length(bytes(client.read(0, 8)), remote.size, where)
    return parse_header(bytes(client.read(8, 8 + n)), remote.size, where)


def read_shard_headers(
    settings: HubSettings, repo: RepoCache, commit: str, shards: list[RemoteFile]
) -> dict[str, Header]:
    """Parse each shard's header from the cache when an intact-sized copy is there, else by HTTP Range.

    A cached copy whose header does not parse is left for :func:`fetch_weights` to repair; its header comes
    from the hub meanwhile.
    """
    headers: dict[str, Header] = {}
    remote_needed: list[tuple[RemoteFile, str]] = []
    for remote in shards:
        pointer = repo.snapshot(commit, remote.path)
        if not pointer.exists():
            remote_needed.append((remote, "missing"))
            continue
        if remote.size is not None and pointer.stat().st_size != remote.size:
            remote_needed.append((remote, f"{pointer.stat().st_size} bytes, expected {remote.size}"))
            continue
        try:
            headers[remote.path] = read_local_header(pointer, f"{repo.repo_id}@{commit[:12]}/{remote.path}")
        except (ModelInputError, OSError) as e:
            remote_needed.append((remote, f"unreadable header: {e}"))
    if remote_needed and settings.offline:
        raise offline_error(settings, repo, commit, remote_needed)

    def fetch(remote: RemoteFile) -> Header:
        try:
            return read_remote_header(settings, repo.repo_id, commit, remote)
        except Exception as e:
            if is_network_error(e):
                raise HubUnavailableError(
                    f"cannot read the header of {repo.repo_id}/{remote.path} from {settings.endpoint} ({e})"
                ) from e
            raise

    todo = [remote for remote, _ in remote_needed]
    if todo:
        with ThreadPoolExecutor(max_workers=min(_THREADS, len(todo))) as pool:
            headers.update(zip([r.path for r in todo], pool.map(fetch, todo)))
    return {remote.path: headers[remote.path] for remote in shards}

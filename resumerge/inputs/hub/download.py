"""Download one blob into the hub cache so that an interrupted transfer continues where it stopped.

huggingface_hub >= 1.18 writes each download to a temp file unique to the process and deletes it on failure
(PR #4306), so a killed or failed run starts that file from zero. resumerge therefore streams the blob itself
(:func:`_fetch`: huggingface_hub's session and token, its error check, and what its ``http_get`` does beside:
retries with ``Range`` after a dropped connection, the rewind when a server answers a ``Range`` with the whole
file, the length check), into ``blobs/<etag>.resumerge.incomplete`` under the same lock huggingface_hub takes; the
next run re-opens that file and asks only for the rest. The content is hashed while it arrives and must match the
hub's checksum before the file is renamed to ``blobs/<etag>``; ``hf_hub_download`` then creates the snapshot entry.

A file whose first bytes this process already holds (its header, read by range when the run was planned) starts the
same way: those bytes are written to the empty partial file first and only the rest is asked for. They are hashed
with the rest, so the hub's checksum covers them as it covers every downloaded byte.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import BinaryIO, Protocol

from huggingface_hub import constants, hf_hub_download

from resumerge.errors import HostileFileError, StorageError
from resumerge.inputs.hub._hf import TRANSPORT_ERRORS, WeakFileLock, build_hf_headers, stream_get
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache
from resumerge.inputs.hub.counters import DOWNLOAD_CHUNK as DOWNLOAD_CHUNK
from resumerge.inputs.hub.events import ByteMeter, HubEvent, ProgressCallback
from resumerge.inputs.hub.records import RACY_WINDOW_NS, VerifyRecords, now_ns
from resumerge.inputs.hub.remote import LIBRARY, HubUnavailableError, hub_errors, is_network_error, resolve_url
from resumerge.inputs.hub.verify import Hasher, check_cached, hash_file, new_hasher

PARTIAL_SUFFIX = ".resumerge.incomplete"  # `hf cache prune` removes leftover *.incomplete files too
# As ``http_get``: a dropped connection is retried this many times in a row (a received byte resets the count),
# a second apart; a throttled answer (408, 429) is asked again after its Retry-After or a doubling wait.
_RETRIES = 5
_BUSY = (408, 429)
_BUSY_WAIT_MAX = 60.0


class Landing(Protocol):
    """Told of a download's bytes as they are written, for a merge that reads them before the end
    (:class:`resumerge.inputs.hub.landing.Landing`)."""

    def opened(self, fileno: int, have: int) -> None: ...

    def grew(self, size: int) -> None: ...

    def rewound(self, size: int) -> None: ...

    def before_retry(self, seeded: bool) -> None: ...

    def finished(self, path: Path) -> None: ...


class _Sink:
    """Where :func:`_fetch` writes: through to the file, hashing and metering what arrives.

    :func:`_fetch` rewinds and truncates when a server answers a ``Range`` request with the whole file; the
    hash then starts over with the file.
    """

    def __init__(self, f: BinaryIO, remote: RemoteFile, hasher: Hasher, meter: ByteMeter,
                 landing: Landing | None = None) -> None:
        self._f = f
        self._landing = landing
        self._remote = remote
        self.hasher = hasher
        self.hash_valid = True
        self._meter = meter

    def write(self, data: bytes) -> int:
        n = self._f.write(data)
        # Flushed per chunk (DOWNLOAD_CHUNK), so a killed run leaves every received byte for the next one to reuse.
        self._f.flush()
        if self.hash_valid:
            self.hasher.update(data)
        self._meter.add(len(data))
        if self._landing is not None:
            self._landing.grew(self._f.tell())  # readers of the merge may use these bytes now
        return n

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos = self._f.seek(offset, whence)
        if pos != os.fstat(self._f.fileno()).st_size:
            self.hash_valid = False  # anything but the end means earlier bytes will be rewritten
        return pos

    def truncate(self, size: int | None = None) -> int:
        n = self._f.truncate(size)
        if self._landing is not None:
            self._landing.rewound(n)
        if n == 0:
            self.hasher, self.hash_valid = new_hasher(self._remote, self._remote.size or 0), True
        else:
            self.hash_valid = False
        self._meter.restart(n)
        return n


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def partial_size(repo: RepoCache, remote: RemoteFile) -> int:
    """Bytes of ``remote`` already received by an earlier, interrupted run."""
    return _partial_bytes(repo.blob(remote.etag + PARTIAL_SUFFIX))


def check_free_space(repo: RepoCache, todo: list[RemoteFile]) -> None:
    """Raise :class:`StorageError` with the numbers if the cache's disk cannot hold the rest of ``todo``."""
    need = sum(max(0, (f.size or 0) - partial_size(repo, f)) for f in todo)
    free = free_bytes(repo.root / "blobs")
    if need > free:
        raise StorageError(
            f"{repo.repo_id}: {len(todo)} file(s) still need {_human(need)} in {repo.cache_dir}, "
            f"but only {_human(free)} is free",
            hint="free some space, or point HF_HUB_CACHE (or --transformers-cache) at a larger disk",
            path=str(repo.cache_dir),
        )


def download_blob(
    settings: HubSettings,
    repo: RepoCache,
    commit: str,
    remote: RemoteFile,
    records: VerifyRecords,
    emit: ProgressCallback,
    landing: Landing | None = None,
    prefix: bytes = b"",
) -> None:
    """Make ``blobs/<etag>`` hold ``remote``'s verified content, continuing any partial download.

    ``prefix`` is the file's first bytes as this process read them already (the header the run was planned from,
    :func:`~resumerge.inputs.hub.headercheck.known_prefix`): a download with no partial file starts from them and
    asks the hub only for the rest. If the file then fails its checksum it is fetched again from its first byte,
    since the prefix may be what differs (the header check then names it).

    ``landing`` follows the bytes as they are written, for a merge that reads them before the end
    (:mod:`~resumerge.inputs.hub.landing`); then a download that fails its checksum after bytes were read is not
    fetched again here: the landing fails instead. Keeps a blob that another process completed meanwhile if it
    verifies. Raises
    :class:`HubUnavailableError` when the transfer fails after huggingface_hub's retries (the partial file is
    kept for the next run), :class:`HostileFileError` when the hub's bytes do not match its own checksum twice.
    """
    blob = repo.blob(remote.etag)
    partial = blob.with_name(remote.etag + PARTIAL_SUFFIX)
    lock = repo.lock(remote.etag)
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():
            # Another process finished it while this one waited for the lock: trust it only once checked.
            if check_cached(blob, remote, records, repo.repo_id, emit) is None:
                return
            blob.unlink()
        for attempt in range(2):
            seeded = attempt == 0 and _seed(partial, prefix, remote.size)
            digest = _stream(settings, repo, commit, remote, partial, emit, landing)
            if digest == remote.etag:
                break
            # A partial torn by a crash, bad bytes in transit, or a prefix that is not the file's: drop it and fetch
            # the whole file once more.
            partial.unlink(missing_ok=True)
            if landing is not None:
                landing.before_retry(seeded)  # raises when the merge read from the bad bytes
            if attempt == 0:
                emit(refetch_event(repo.repo_id, remote, f"downloaded content fails its {remote.algorithm} check"))
        else:
            raise HostileFileError(
                f"{repo.repo_id}@{commit[:12]}/{remote.path}: the hub serves content whose {remote.algorithm} "
                f"is not the {remote.etag} it lists",
                hint="report it to the repo owner; nothing was kept",
            )
        # Backdate the mtime so the record below is trusted at once: any later write gets a newer mtime.
        stamp = now_ns() - 2 * RACY_WINDOW_NS
        os.utime(partial, ns=(stamp, stamp))
        os.replace(partial, blob)
        _fsync_dir(blob.parent)
        records.record(blob, remote.algorithm, digest, now_ns())


def _seed(partial: Path, prefix: bytes, size: int | None) -> bool:
    """Start an absent or empty ``partial`` with ``prefix``; whether it did. A partial an earlier run left is kept
    as it is: it is continued from its own bytes."""
    if not prefix or size is None or len(prefix) > size or _partial_bytes(partial) > 0:
        return False
    with open(partial, "wb") as f:
        f.write(prefix)
    return True


def _partial_bytes(partial: Path) -> int:
    """The size of ``partial``, 0 when it is absent."""
    try:
        return partial.stat().st_size
    except OSError:
        return 0


def link_snapshot(settings: HubSettings, repo: RepoCache, commit: str, remote: RemoteFile) -> Path:
    """Create ``snapshots/<commit>/<path>`` for an existing blob with ``hf_hub_download`` and return it.

    The blob is present, so huggingface_hub only sends a HEAD request and links it (copying where symlinks
    are not supported). Raises :class:`HubUnavailableError` if the hub cannot be reached.
    """
    pointer = repo.snapshot(commit, remote.path)
    if pointer.exists():
        return pointer
    if pointer.is_symlink():
        pointer.unlink()  # dangling: it pointed at a blob name that is not this file's checksum
    try:
        with hub_errors(settings, repo.repo_id, commit):
            path = hf_hub_download(
                repo.repo_id,
                remote.path,
                revision=commit,
                cache_dir=settings.cache_dir,
                endpoint=settings.endpoint,
                library_name=LIBRARY,
            )
    except Exception as e:
        if is_network_error(e):
            raise HubUnavailableError(f"cannot reach {settings.endpoint} to link {remote.path} ({e})") from e
        raise
    return Path(path)


def _stream(
    settings: HubSettings, repo: RepoCache, commit: str, remote: RemoteFile, partial: Path, emit: ProgressCallback,
    landing: Landing | None = None,
) -> str:
    """Append the missing bytes of ``remote`` to ``partial`` and return the checksum of the whole file."""
    size = remote.size or 0
    url = resolve_url(settings, repo.repo_id, commit, remote.path)
    with open(partial, "a+b") as f:
        have = f.seek(0, os.SEEK_END)
        if have > size:
            have = f.truncate(0)
        hasher = new_hasher(remote, size)
        f.seek(0)
        while have and (chunk := f.read(min(8 << 20, have - f.tell()))):
            hasher.update(chunk)  # the bytes of an earlier run count towards the checksum
        if landing is not None:
            landing.opened(f.fileno(), have)
        meter = ByteMeter(emit, "download", repo.repo_id, remote.path, done=have, total=size)
        sink = _Sink(f, remote, hasher, meter, landing)
        try:
            with hub_errors(settings, repo.repo_id, commit):
                _fetch(url, sink, have=have, size=size, name=remote.path)
        except Exception as e:
            got = f.seek(0, os.SEEK_END)
            if is_network_error(e):
                raise HubUnavailableError(
                    f"download of {repo.repo_id}/{remote.path} stopped at {got} of {size} bytes ({e})",
                    hint="run the same command again to continue from there",
                ) from e
            if isinstance(e, OSError) and "Consistency check failed" in str(e):
                f.truncate(0)  # the server sent a different length than it listed: nothing here is reusable
                raise HubUnavailableError(f"download of {repo.repo_id}/{remote.path} failed: {e}") from e
            raise
        finally:
            meter.finish()
        os.fsync(f.fileno())
        if sink.hash_valid:
            return sink.hasher.hexdigest()
    return hash_file(partial, remote)


def _fetch(url: str, sink: _Sink, *, have: int, size: int, name: str) -> None:
    """Append bytes ``have`` to ``size`` of ``url`` to ``sink``, through huggingface_hub's session (its client,
    proxies, redirects) with its headers and token. Raises huggingface_hub's error for an error status, the client's
    transport error once :data:`_RETRIES` tries in a row received nothing, and ``OSError("Consistency check
    failed…")`` when the body ends at another length than ``size``."""
    headers = build_hf_headers(library_name=LIBRARY)
    got, retries, busy = have, _RETRIES, 0
    while got != size:
        asked = {**headers, "Range": f"bytes={got}-"} if got else headers
        try:
            with stream_get(url, headers=asked, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                if response.status_code in _BUSY and busy < _RETRIES:
                    busy += 1
                    time.sleep(_busy_wait(response.headers.get("Retry-After"), busy))
                    continue
                if response.status_code >= 400:  # (the check reads the body: a 2xx's must stream)
                    response.raise_for_hub_status()
                if got and response.status_code == 200:
                    # The server ignored the Range (a CDN compressing the body): the whole file comes again.
                    sink.seek(0)
                    got = sink.truncate()
                for chunk in response.iter_bytes(DOWNLOAD_CHUNK):
                    sink.write(chunk)
                    got += len(chunk)
                    retries = _RETRIES
            break
        except TRANSPORT_ERRORS:
            if retries <= 0:
                raise
            retries -= 1
            time.sleep(1)
    if got != size:
        raise OSError(f"Consistency check failed: file should be of size {size} but has size {got} ({name})")


def _busy_wait(retry_after: str | None, attempt: int) -> float:
    """Seconds to wait before asking a throttling server again: its ``Retry-After`` (seconds), else 1, 2, 4, …"""
    try:
        wait = float(retry_after) if retry_after is not None else float(2 ** (attempt - 1))
    except ValueError:
        wait = float(2 ** (attempt - 1))
    return min(max(wait, 0.0), _BUSY_WAIT_MAX)


def refetch_event(repo_id: str, remote: RemoteFile, reason: str) -> HubEvent:
    """The event announcing that ``remote`` is fetched again because of ``reason``."""
    return HubEvent("refetch", repo_id, f"{remote.path}: {reason}; fetching it again", filename=remote.path)


def _fsync_dir(path: Path) -> None:
    """Make the rename durable; best effort, as some file systems (FUSE mounts, Windows) refuse it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{n:,} bytes" if unit == "B" else f"{value:.1f} {unit} ({n:,} bytes)"
        value /= 1000
    raise AssertionError("unreachable")  # pragma: no cover

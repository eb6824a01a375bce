"""Download one blob into the hub cache so that an interrupted transfer continues where it stopped.

huggingface_hub >= 1.18 writes each download to a temp file unique to the process and deletes it on failure
(PR #4306), so a killed or failed run starts that file from zero. resumerge therefore streams the blob itself,
with huggingface_hub's ``http_get`` (same client, token, redirects, in-call retries with ``Range``), into
``blobs/<etag>.resumerge.incomplete`` under the same lock huggingface_hub takes; the next run re-opens that
file and asks only for the rest. The content is hashed while it arrives and must match the hub's checksum
before the file is renamed to ``blobs/<etag>``; ``hf_hub_download`` then creates the snapshot entry.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

from huggingface_hub import constants, hf_hub_download

from resumerge.errors import HostileFileError, StorageError
from resumerge.inputs.hub._hf import WeakFileLock, build_hf_headers, http_get, http_get_kwargs
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache
from resumerge.inputs.hub.events import ByteMeter, HubEvent, ProgressCallback
from resumerge.inputs.hub.records import RACY_WINDOW_NS, VerifyRecords, now_ns
from resumerge.inputs.hub.remote import LIBRARY, HubUnavailableError, hub_errors, is_network_error, resolve_url
from resumerge.inputs.hub.verify import Hasher, check_cached, hash_file, new_hasher

PARTIAL_SUFFIX = ".resumerge.incomplete"  # `hf cache prune` removes leftover *.incomplete files too
# The pieces ``http_get`` hands to the file. huggingface_hub gathers 10 MiB ones through an in-memory buffer: fresh
# memory for every piece, which the kernel faults in and zeroes. Measured on the project's 2-core VM, the CPU of a
# process downloading 400 MB: 3.8-4.1 s with 10 MiB pieces (a stream was paced near 50 MB/s by its own CPU, not by
# the link), 2.2-2.5 s with 1 MiB, 1.9-2.1 s with 256 KiB, about the same with 64 KiB (bench/RESULTS.md, session
# 12). ``http_get`` takes no chunk size, so ``_stream`` lowers huggingface_hub's constant (never raises it).
DOWNLOAD_CHUNK = 256 * 1024


class Landing(Protocol):
    """Told of a download's bytes as they are written, for a merge that reads them before the end
    (:class:`resumerge.inputs.hub.landing.Landing`)."""

    def opened(self, fileno: int, have: int) -> None: ...

    def grew(self, size: int) -> None: ...

    def rewound(self, size: int) -> None: ...

    def before_retry(self) -> None: ...

    def finished(self, path: Path) -> None: ...


class _SilentBar:
    """A tqdm stand-in for ``http_get``: progress goes through :class:`ByteMeter` events instead."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _SilentBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: float | None = 1) -> None:
        pass


class _Sink:
    """The file object handed to ``http_get``: writes through, hashes and meters what arrives.

    ``http_get`` rewinds and truncates when a server answers a ``Range`` request with the whole file; the
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
    try:
        return repo.blob(remote.etag + PARTIAL_SUFFIX).stat().st_size
    except OSError:
        return 0


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
) -> None:
    """Make ``blobs/<etag>`` hold ``remote``'s verified content, continuing any partial download.

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
            digest = _stream(settings, repo, commit, remote, partial, emit, landing)
            if digest == remote.etag:
                break
            # A partial torn by a crash, or bad bytes in transit: drop it and fetch the whole file once more.
            partial.unlink(missing_ok=True)
            if landing is not None:
                landing.before_retry()  # raises when the merge read from the bad bytes
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
        constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, DOWNLOAD_CHUNK)
        try:
            with hub_errors(settings, repo.repo_id, commit):
                http_get(
                    url,
                    cast(BinaryIO, sink),
                    **http_get_kwargs(
                        resume_size=have,
                        headers=build_hf_headers(library_name=LIBRARY),
                        expected_size=size,
                        displayed_filename=remote.path,
                        tqdm_class=_SilentBar,
                    ),
                )
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

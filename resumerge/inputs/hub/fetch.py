"""Make a set of files of one commit present and verified in the hub cache, fetching only what is not.

Every file is checked against the hub's checksum (once; see :mod:`resumerge.inputs.hub.records`); a missing, corrupt
or truncated file is fetched again, exactly that file. Offline, damage is reported with the file names and the
command that repairs them. Nothing touches the network when every file is cached and verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from resumerge.errors import ModelInputError, ResumergeError
from resumerge.inputs.gguf.header import GgufHeader
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache, default_cache_dir
from resumerge.inputs.hub.download import Landing, check_free_space, download_blob, link_snapshot, refetch_event
from resumerge.inputs.hub.events import ProgressCallback
from resumerge.inputs.hub.headercheck import check_header, known_prefix
from resumerge.inputs.hub.records import VerifyRecords
from resumerge.inputs.hub.remote import HubUnavailableError
from resumerge.inputs.hub.verify import check_cached
from resumerge.inputs.safetensors_format import Header


def ensure_files(
    settings: HubSettings,
    repo: RepoCache,
    commit: str,
    wanted: list[RemoteFile],
    records: VerifyRecords,
    emit: ProgressCallback,
    prefixes: Mapping[str, bytes] | None = None,
) -> dict[str, Path]:
    """Return ``{repo path: snapshot path}`` for ``wanted``, each verified against the hub's checksum.

    ``prefixes`` maps a repo path to the first bytes of that file as this process read them already (the header a
    plan was made from): its download starts from them (:func:`~resumerge.inputs.hub.download.download_blob`).

    Raises :class:`ModelInputError` offline when a file is missing or damaged (naming each file and the
    repair command), :class:`~resumerge.errors.StorageError` before any download if the disk is too small,
    and what :func:`~resumerge.inputs.hub.download.download_blob` raises.
    """
    ready: dict[str, Path] = {}
    link_only: list[RemoteFile] = []
    fetch: list[tuple[RemoteFile, str]] = []
    for remote in wanted:
        pointer = repo.snapshot(commit, remote.path)
        reason = check_cached(pointer, remote, records, repo.repo_id, emit)
        if reason is None:
            ready[remote.path] = pointer
        elif reason == "missing" and check_cached(repo.blob(remote.etag), remote, records, repo.repo_id, emit) is None:
            link_only.append(remote)  # e.g. the same blob is cached for another commit
        else:
            fetch.append((remote, reason))
    if not link_only and not fetch:
        return ready
    if settings.offline:
        raise offline_error(settings, repo, commit, [(r, "missing") for r in link_only] + fetch)
    check_free_space(repo, [remote for remote, _ in fetch])
    for remote, reason in fetch:
        if reason != "missing":
            emit(refetch_event(repo.repo_id, remote, f"cached copy is damaged ({reason})"))
            _discard(repo.snapshot(commit, remote.path))
        download_blob(settings, repo, commit, remote, records, emit, prefix=(prefixes or {}).get(remote.path, b""))
        ready[remote.path] = link_snapshot(settings, repo, commit, remote)
    for remote in link_only:
        ready[remote.path] = link_snapshot(settings, repo, commit, remote)
    return {remote.path: ready[remote.path] for remote in wanted}


def land_file(settings: HubSettings, repo: RepoCache, commit: str, remote: RemoteFile, records: VerifyRecords,
              emit: ProgressCallback, landing: Landing, header: Header | GgufHeader | None = None) -> Path:
    """Download ``remote`` into the cache while ``landing`` tells readers which bytes have arrived; returns its
    verified snapshot path (and tells ``landing``). A blob already cached for another commit is only linked.

    The caller checked free space and offline mode for every file first (:func:`check_downloads`). ``header`` is the
    one the merge was planned from: the verified file must start with it, else
    :class:`~resumerge.inputs.hub.headercheck.HubHeaderChanged` is raised and ``landing`` is never told the file is
    checked. The download starts from the bytes of ``header`` this process holds already
    (:func:`~resumerge.inputs.hub.headercheck.known_prefix`), and asks the hub only for the rest.
    """
    pointer = repo.snapshot(commit, remote.path)
    reason = check_cached(pointer, remote, records, repo.repo_id, emit)
    if reason is not None and check_cached(repo.blob(remote.etag), remote, records, repo.repo_id, emit) is not None:
        if reason != "missing":
            emit(refetch_event(repo.repo_id, remote, f"cached copy is damaged ({reason})"))
            _discard(pointer)
        download_blob(settings, repo, commit, remote, records, emit, landing,
                      known_prefix(header) if header is not None else b"")
    path = link_snapshot(settings, repo, commit, remote) if reason is not None else pointer
    if header is not None:
        check_header(path, header, f"{repo.repo_id}@{commit[:12]}/{remote.path}")
    landing.finished(path)
    return path


def check_downloads(settings: HubSettings, repo: RepoCache, commit: str, todo: list[RemoteFile]) -> None:
    """Refuse, before any byte is fetched, downloads that cannot happen: offline mode (naming the files and the
    repair command) or a cache disk too small for them."""
    if not todo:
        return
    if settings.offline:
        raise offline_error(settings, repo, commit, [(r, "missing") for r in todo])
    check_free_space(repo, todo)


def offline_error(
    settings: HubSettings, repo: RepoCache, commit: str, problems: list[tuple[RemoteFile, str]]
) -> ResumergeError:
    """Build the error for files missing or damaged while the hub is off limits, naming each file.

    Returns :class:`ModelInputError` with the repair command when offline mode is on, or
    :class:`HubUnavailableError` when the hub just did not answer (running again later fetches them).
    """
    names = [remote.path for remote, _ in problems]
    listed = "; ".join(f"{remote.path} ({reason})" for remote, reason in problems)
    where = f"{repo.repo_id}@{commit[:12]}: {listed} in the hub cache {repo.cache_dir}"
    if settings.unreachable:
        return HubUnavailableError(f"{where}, and {settings.endpoint} cannot be reached")
    return ModelInputError(
        f"{where}, and offline mode is on",
        hint=f"repair with `{repair_command(settings, repo.repo_id, commit, names)}`"
        " (or run once without HF_HUB_OFFLINE)",
    )


def repair_command(settings: HubSettings, repo_id: str, commit: str, names: list[str]) -> str:
    """The ``hf download`` command that re-fetches ``names`` of ``repo_id`` at ``commit`` into this cache."""
    parts = ["HF_HUB_OFFLINE=0 hf download", repo_id, *names, "--revision", commit, "--force-download"]
    if settings.cache_dir != default_cache_dir():
        parts += ["--cache-dir", str(settings.cache_dir)]
    return " ".join(parts)


def _discard(pointer: Path) -> None:
    """Remove a damaged cached file: its blob, and the snapshot entry itself if it is a copy."""
    real = pointer.resolve()
    real.unlink(missing_ok=True)
    if not pointer.is_symlink():
        pointer.unlink(missing_ok=True)

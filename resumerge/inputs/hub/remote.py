"""Everything that talks to the hub, through huggingface_hub's own client (token, endpoint, offline hook).

Hub errors become resumerge errors here: a missing repo, revision or file, or a gated repo, is the user's
input problem (:class:`~resumerge.errors.ModelInputError`); a hub that cannot be reached is
:class:`HubUnavailableError` unless the caller can fall back to the cache (see :func:`is_network_error`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile

from resumerge.errors import ModelInputError, UnreachableError
from resumerge.inputs.hub._hf import TRANSPORT_ERRORS, build_hf_headers, is_remote_entry_missing, stream_get
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, check_repo_path

LIBRARY = "resumerge"
_RETRIES = 3


class HubUnavailableError(UnreachableError):
    """The hub could not be reached and the cache cannot stand in; running again later resumes."""


def is_network_error(error: BaseException) -> bool:
    """Return whether ``error`` means "the hub is unreachable right now" rather than "the request is wrong"."""
    if isinstance(error, (*TRANSPORT_ERRORS, OfflineModeIsEnabled, LocalEntryNotFoundError)):
        return True
    if isinstance(error, HfHubHTTPError) and not isinstance(error, RepositoryNotFoundError):
        status = error.response.status_code if error.response is not None else 0
        return status >= 500 or status in (408, 429)
    return False


@contextmanager
def hub_errors(settings: HubSettings, repo_id: str, revision: str) -> Iterator[None]:
    """Translate huggingface_hub's errors about ``repo_id@revision`` into resumerge errors.

    Raises :class:`ModelInputError` for an unknown repo, revision or file and for gated or forbidden repos;
    network errors pass through unchanged so the caller can decide whether the cache can stand in.
    """
    where = f"{repo_id}@{revision}"
    try:
        yield
    except GatedRepoError as e:
        raise ModelInputError(
            f"{repo_id} is gated on {settings.endpoint} and this token has no access",
            hint="accept the conditions on the model page, then set HF_TOKEN (or run `hf auth login`)",
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelInputError(
            f"no such directory {repo_id!r}, nor a model repo of that name (a hub id like org/name) on "
            f"{settings.endpoint}",
            hint="check the spelling; for a private repo set HF_TOKEN (or run `hf auth login`)",
        ) from e
    except RevisionNotFoundError as e:
        raise ModelInputError(
            f"{repo_id} has no revision {revision!r}", hint="use an existing branch, tag or commit after '@'"
        ) from e
    except HfHubHTTPError as e:
        if is_remote_entry_missing(e):
            raise ModelInputError(f"{where}: a file the repo lists is missing on the hub ({e})") from e
        status = e.response.status_code if e.response is not None else 0
        if status in (401, 403):
            raise ModelInputError(
                f"{settings.endpoint} refused access to {repo_id} (HTTP {status})",
                hint="set HF_TOKEN to a token that can read this repo",
            ) from e
        raise


def resolve_url(settings: HubSettings, repo_id: str, commit: str, filename: str) -> str:
    """The ``resolve`` URL of ``filename`` at ``commit`` on ``settings.endpoint``.

    Built here rather than with ``hf_hub_url``, whose template is fixed when huggingface_hub is imported.
    """
    return f"{settings.endpoint}/{repo_id}/resolve/{quote(commit, safe='')}/{quote(filename)}"


def resolve_revision(settings: HubSettings, repo_id: str, revision: str) -> str:
    """Return the commit sha that ``revision`` (a branch or tag) points at now. One small API request."""
    with hub_errors(settings, repo_id, revision):
        info = _api(settings).model_info(repo_id, revision=revision)
    if not info.sha:
        raise HubUnavailableError(f"{settings.endpoint} answered without a commit for {repo_id}@{revision}")
    return info.sha


def list_files(settings: HubSettings, repo_id: str, commit: str) -> dict[str, RemoteFile]:
    """Return every file of ``repo_id`` at ``commit`` with its size and checksum (the recursive tree listing).

    Raises :class:`~resumerge.errors.HostileFileError` for a path that would leave the repo folder.
    """
    files: dict[str, RemoteFile] = {}
    with hub_errors(settings, repo_id, commit):
        for entry in _api(settings).list_repo_tree(repo_id, revision=commit, recursive=True):
            if isinstance(entry, RepoFile):
                path = check_repo_path(entry.path, repo_id)
                sha = entry.lfs.sha256 if entry.lfs is not None else None
                size = entry.lfs.size if entry.lfs is not None else entry.size
                files[path] = RemoteFile(path, size, entry.blob_id, sha)
    return files


def read_range(settings: HubSettings, repo_id: str, commit: str, filename: str, start: int, length: int) -> bytes:
    """Return ``length`` bytes of ``filename`` at ``commit`` from offset ``start`` with an HTTP Range request.

    A server that ignores ``Range`` (200 instead of 206) is read only up to the bytes needed, then the
    connection is dropped, so a multi-gigabyte file is never downloaded for its header. Retries transient
    network errors twice. Raises :class:`ModelInputError` if the file is shorter than asked.
    """
    url = resolve_url(settings, repo_id, commit, filename)
    headers = build_hf_headers(library_name=LIBRARY)
    headers["Range"] = f"bytes={start}-{start + length - 1}"
    headers["Accept-Encoding"] = "identity"
    for attempt in range(_RETRIES):
        try:
            with hub_errors(settings, repo_id, commit):
                return _read_range_once(url, headers, start, length, f"{repo_id}@{commit[:12]}/{filename}")
        except TRANSPORT_ERRORS:
            if attempt == _RETRIES - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _read_range_once(url: str, headers: dict[str, str], start: int, length: int, where: str) -> bytes:
    timeout = constants.HF_HUB_DOWNLOAD_TIMEOUT
    with stream_get(url, headers=headers, timeout=timeout) as response:
        if response.status_code >= 400:
            response.raise_for_hub_status()
        skip = start if response.status_code == 200 else 0
        data = bytearray()
        for chunk in response.iter_bytes():
            if skip:
                dropped = min(skip, len(chunk))
                chunk, skip = chunk[dropped:], skip - dropped
            data += chunk
            if len(data) >= length:
                return bytes(data[:length])
    raise ModelInputError(f"{where} ends after {start + len(data)} bytes, before the {length} bytes asked for")


def _api(settings: HubSettings) -> HfApi:
    return HfApi(endpoint=settings.endpoint, library_name=LIBRARY)

"""A GGUF file in a hub repo as a model input: ``model: org/repo/Model-Q4_K_M.gguf`` (``[@revision]`` after it).

A reference whose path ends in ``.gguf``, is not on disk, and starts with a valid repo id followed by a path in
that repo names that file of that repo (or the split set it is the first part of). The repo is pinned at a commit
and listed; a repo without the file (or a part of its split set) is refused in one line. Then the first file's
header is read by HTTP Range (a first MiB, more while the header runs past it; no tensor data) and the file must
be a GGUF of a family resumerge maps, else one line, exit 2, before anything is downloaded. Only then is every
file of the set downloaded into the hub cache and verified against the hub's checksum, as safetensors downloads
are; the model is then opened from its snapshot like a local GGUF (its folder recorded, so a resume reads the
same commit).
"""

from __future__ import annotations

import os
from pathlib import Path

from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError
from resumerge.inputs.gguf.header import parse_gguf_header
from resumerge.inputs.gguf.model import decodable_sizes, split_names
from resumerge.inputs.gguf.names import family
from resumerge.inputs.hub._hf import validate_repo_id
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache, hub_settings
from resumerge.inputs.hub.events import ProgressCallback, callback_or_noop
from resumerge.inputs.hub.fetch import ensure_files
from resumerge.inputs.hub.ranges import RangeClient
from resumerge.inputs.hub.records import VerifyRecords
from resumerge.inputs.hub.resolve import _list_files, _pin_commit


def hub_gguf(ref: ModelRef) -> tuple[str, str] | None:
    """(repo id, path in the repo) when ``ref`` names a GGUF file in a hub repo, else None (a local path, or not a
    ``.gguf``)."""
    if not ref.path.endswith(".gguf") or os.path.exists(os.path.expanduser(ref.path)):
        return None
    parts = ref.path.split("/")
    if len(parts) < 3 or any(not part for part in parts):
        return None
    repo_id = "/".join(parts[:2])
    try:
        validate_repo_id(repo_id)
    except ValueError:
        return None
    return repo_id, "/".join(parts[2:])


def resolve_gguf(
    ref: ModelRef,
    *,
    cache_dir: str | Path | None = None,
    pinned_commit: str | None = None,
    records_dir: str | Path | None = None,
    on_progress: ProgressCallback | None = None,
) -> Path:
    """The verified snapshot path of the hub GGUF ``ref`` (its split set's first file), at ``pinned_commit`` (a
    resume) or the revision's current commit. Raises :class:`ModelInputError` (exit 2, before any download) for a
    repo without the file or a part of its set, a file that is not a GGUF, or a family resumerge cannot map; and
    what :func:`~resumerge.inputs.hub.resolve_metadata` raises for an unknown repo or an unreachable hub."""
    found = hub_gguf(ref)
    if found is None:
        raise ValueError(f"{ref.path!r} does not name a GGUF file in a hub repo")
    repo_id, path = found
    settings = hub_settings(cache_dir, None, None)
    emit = callback_or_noop(on_progress)
    repo = RepoCache(settings.cache_dir, repo_id)
    settings, commit = _pin_commit(settings, repo, ref.revision or "main", pinned_commit, emit)
    settings, files, _ = _list_files(settings, repo, commit, emit)
    where = f"{repo_id}@{commit[:12]}"
    folder, _, name = path.rpartition("/")
    names = [f"{folder}/{n}" if folder else n for n in split_names(name, f"{where}/{path}")]
    missing = [n for n in names if n not in files]
    if missing:
        ggufs = sorted(p for p in files if p.endswith(".gguf"))
        shown = ", ".join(ggufs[:6]) + (", ..." if len(ggufs) > 6 else "")
        raise ModelInputError(f"{where} has no file {missing[0]}",
                              hint=f"its GGUF files: {shown}" if ggufs else "the repo has no .gguf file")
    first = files[names[0]]
    if not settings.offline and not _cached_whole(repo, commit, first):
        _check_header(settings, repo_id, commit, first, f"{where}/{first.path}")
    with VerifyRecords(records_dir) as records:
        ready = ensure_files(settings, repo, commit, [files[n] for n in names], records, emit)
    return ready[names[0]]


def _cached_whole(repo: RepoCache, commit: str, remote: RemoteFile) -> bool:
    pointer = repo.snapshot(commit, remote.path)
    return pointer.is_file() and remote.size is not None and pointer.stat().st_size == remote.size


def _check_header(settings: HubSettings, repo_id: str, commit: str, remote: RemoteFile, where: str) -> None:
    """Read the GGUF header of ``remote`` by range and refuse, in one line, a file that is not a GGUF or whose
    family resumerge does not map."""
    if remote.size is None or remote.size < 24:
        raise ModelInputError(f"{where} is not a GGUF file ({remote.size} bytes)")
    client = RangeClient(settings, repo_id, commit, remote.path, remote.size)
    magic = bytes(client.read(0, 4))
    if magic != b"GGUF":
        raise ModelInputError(f"{where} is not a GGUF file (it does not start with GGUF's magic)",
                              hint="name a .gguf file of the repo, or the repo itself for its safetensors")
    header = parse_gguf_header(lambda start, end: bytes(client.read(start, end)), remote.size, where,
                               decodable_sizes())
    family(header.metadata, where)

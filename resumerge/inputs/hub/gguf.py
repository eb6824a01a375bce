"""A GGUF file in a hub repo as a model input: ``model: org/repo/Model-Q4_K_M.gguf`` (``[@revision]`` after it, or
after the repo id: ``org/repo@revision/Model-Q4_K_M.gguf``).

A reference whose path ends in ``.gguf``, is not on disk, and starts with a valid repo id followed by a path in
that repo names that file of that repo (or the split set it is the first part of). The repo is pinned at a commit
and listed; a repo without the file (or a part of its split set) is refused in one line. Then each file's header is
read by HTTP Range (:func:`~resumerge.inputs.gguf.header.parse_gguf_header`: a first 64 KiB, more while the header
runs past it), or from the hub cache when the file is there whole; a file that is not a GGUF, or of a family
resumerge does not map, is refused in one line (exit 2) before a tensor byte is read.

Nothing else is fetched here: the model becomes a hub input like a safetensors repo (:class:`RepoMetadata` whose
``headers`` are the GGUF headers), so the run decides per file, as it does for safetensors shards
(:func:`~resumerge.merge.plan.fetching.choose_fetch`), whether to read it from the cache, download it while merging
(verified against the hub's sha256) or stream the tensors it needs by range (each range's sha256 recorded in the
run's ledger, and the hub's sha256 checked when every tensor was streamed). The model's directory is the cache
snapshot of the pinned commit and its files are named by their paths in the repo, so a resume reads the same
commit and ``plan`` downloads nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError
from resumerge.inputs.files import InputFile
from resumerge.inputs.gguf.header import GgufHeader, is_gguf, parse_gguf_header, read_gguf_header
from resumerge.inputs.gguf.model import decodable_sizes, gguf_model, split_names
from resumerge.inputs.gguf.names import family
from resumerge.inputs.hub._hf import validate_repo_id
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache, hub_settings
from resumerge.inputs.hub.events import ProgressCallback, callback_or_noop
from resumerge.inputs.hub.fetch import offline_error
from resumerge.inputs.hub.ranges import RangeClient
from resumerge.inputs.hub.resolve import RepoMetadata, commit_files, pin_commit
from resumerge.inputs.model import ModelInput

FIRST_READ = 64 << 10  # the first range of a header read: the fixed part, and small headers whole


def hub_gguf(ref: ModelRef) -> tuple[str, str, str | None] | None:
    """(repo id, path in the repo, revision or None) when ``ref`` names a GGUF file in a hub repo, else None (a
    local path, or not a ``.gguf``). Both spellings: ``org/repo/path/x.gguf@rev`` and ``org/repo@rev/path/x.gguf``
    (there the revision is the part before the first ``/``: a branch with a ``/`` in its name takes the first)."""
    path, revision = ref.path, ref.revision
    if revision is not None and "/" in revision and revision.endswith(".gguf") and path.count("/") == 1:
        revision, _, rest = revision.partition("/")
        path = f"{path}/{rest}"
    if not path.endswith(".gguf") or os.path.exists(os.path.expanduser(ref.path)):
        return None
    parts = path.split("/")
    if len(parts) < 3 or any(not part for part in parts):
        return None
    repo_id = "/".join(parts[:2])
    try:
        validate_repo_id(repo_id)
    except ValueError:
        return None
    return repo_id, "/".join(parts[2:]), revision


def resolve_gguf(
    ref: ModelRef,
    *,
    cache_dir: str | Path | None = None,
    pinned_commit: str | None = None,
    on_progress: ProgressCallback | None = None,
) -> RepoMetadata:
    """What phase one learns of the hub GGUF ``ref`` (its split set's files, in order, as ``weight_files``, and
    their parsed GGUF headers), at ``pinned_commit`` (a resume) or the revision's current commit; no tensor byte is
    read. Raises :class:`ModelInputError` (exit 2) for a repo without the file or a part of its set, a file that is
    not a GGUF, a family resumerge cannot map, or a file neither cached nor reachable in offline mode; and what
    :func:`~resumerge.inputs.hub.resolve_metadata` raises for an unknown repo or an unreachable hub."""
    found = hub_gguf(ref)
    if found is None:
        raise ValueError(f"{ref.path!r} does not name a GGUF file in a hub repo")
    repo_id, path, revision = found[0], found[1], found[2] or "main"
    settings = hub_settings(cache_dir, None, None)
    emit = callback_or_noop(on_progress)
    repo = RepoCache(settings.cache_dir, repo_id)
    settings, commit = pin_commit(settings, repo, revision, pinned_commit, emit)
    settings, files, complete = commit_files(settings, repo, commit, emit)
    where = f"{repo_id}@{commit[:12]}"
    folder, _, name = path.rpartition("/")
    names = [f"{folder}/{n}" if folder else n for n in split_names(name, f"{where}/{path}")]
    missing = [n for n in names if n not in files]
    if missing:
        ggufs = sorted(p for p in files if p.endswith(".gguf"))
        shown = ", ".join(ggufs[:6]) + (", ..." if len(ggufs) > 6 else "")
        raise ModelInputError(f"{where} has no file {missing[0]}",
                              hint=f"its GGUF files: {shown}" if ggufs else "the repo has no .gguf file")
    headers: dict[str, GgufHeader] = {}
    for n in names:
        headers[n] = _header(settings, repo, commit, files[n], f"{where}/{n}")
        if n == names[0]:
            family(headers[n].metadata, f"{where}/{n}")  # refused before the other parts are read
    return RepoMetadata(ref, repo_id, revision, commit, settings, files, complete, {}, tuple(names), headers)


def gguf_input(ref: ModelRef, meta: RepoMetadata) -> ModelInput:
    """The model input of the hub GGUF :func:`resolve_gguf` resolved: its directory the snapshot folder of the
    pinned commit, its files named by their repo paths, each identified by the hub's checksum."""
    headers = tuple((n, h) for n, h in meta.headers.items() if isinstance(h, GgufHeader))
    first = meta.weight_files[0]
    found = gguf_model(headers, f"{meta.repo_id}@{meta.commit[:12]}/{first}")
    files = tuple(InputFile(n, h.file_size, meta.files[n].sha256 or meta.files[n].blob_id) for n, h in headers)
    return ModelInput(ref, meta.snapshot_dir, found.config, found.tensors, files, gguf=first,
                      gguf_header=headers[0][1])


def _header(settings: HubSettings, repo: RepoCache, commit: str, remote: RemoteFile, where: str) -> GgufHeader:
    """The GGUF header of ``remote``: from the cache when the file is there whole (it is verified before the run
    reads a tensor), else read by range. Refuses, in one line, a file that is not a GGUF."""
    cached = repo.snapshot(commit, remote.path)
    if cached.is_file() and (remote.size is None or cached.stat().st_size == remote.size):
        if not is_gguf(cached):
            raise _not_gguf(where)
        return read_gguf_header(cached, decodable_sizes())
    if settings.offline:
        raise offline_error(settings, repo, commit, [(remote, "missing")])
    if remote.size is None or remote.size < 24:
        raise ModelInputError(f"{where} is not a GGUF file ({remote.size} bytes)")
    client = RangeClient(settings, repo.repo_id, commit, remote.path, remote.size)
    first = bytes(client.read(0, min(remote.size, FIRST_READ)))  # the magic and, mostly, the whole header
    if first[:4] != b"GGUF":
        raise _not_gguf(where)

    def read(start: int, end: int) -> bytes:
        return first[start:end] if end <= len(first) else bytes(client.read(start, end))

    return parse_gguf_header(read, remote.size, where, decodable_sizes(), first=len(first))


def _not_gguf(where: str) -> ModelInputError:
    return ModelInputError(f"{where} is not a GGUF file (it does not start with GGUF's magic)",
                           hint="name a .gguf file of the repo, or the repo itself for its safetensors")

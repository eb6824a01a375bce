"""Resolve a hub model in two phases: metadata first (configs, tokenizer, safetensors headers), weights later.

:func:`resolve_metadata` pins the commit, lists the repo, fetches and verifies the small files and reads every
weight shard's safetensors header (from the cache, else with HTTP Range requests), so the planner can validate
layer counts, names and shapes in seconds. :func:`fetch_weights` then downloads and verifies the shards after
a free-space check. Both use the normal huggingface_hub cache and make no request when it already holds every
needed file, verified.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError, ResumergeError
from resumerge.inputs.gguf.header import GgufHeader
from resumerge.inputs.hub._hf import validate_repo_id
from resumerge.inputs.hub.cache import COMMIT_RE, HubSettings, RemoteFile, RepoCache, hub_settings
from resumerge.inputs.hub.events import HubEvent, ProgressCallback, callback_or_noop
from resumerge.inputs.hub.fetch import ensure_files
from resumerge.inputs.hub.headercheck import check_header, known_prefix
from resumerge.inputs.hub.headers import read_shard_headers
from resumerge.inputs.hub.local import is_local as is_local
from resumerge.inputs.hub.local import local_parent, near_folder
from resumerge.inputs.hub.records import VerifyRecords
from resumerge.inputs.hub.remote import HubUnavailableError, is_network_error, list_files, resolve_revision
from resumerge.inputs.hub.selection import select_weights, small_files
from resumerge.inputs.safetensors_format import Header
from resumerge.inputs.torch_bin import is_pickle_checkpoint, read_bin_header

_T = TypeVar("_T")


@dataclass(frozen=True)
class RepoMetadata:
    """What phase one learned about one hub model, enough to validate a merge without its weights.

    ``files`` lists the whole repo at ``commit`` (size and checksum per path); ``listing_complete`` is false
    when it had to be rebuilt offline from the snapshot folder. ``local_files`` maps each small file to its
    verified snapshot path; ``weight_files`` are the shards the merge needs (from the safetensors index, else
    every top-level ``*.safetensors``; a hub GGUF's split set, :mod:`.gguf`), and ``headers`` their parsed
    safetensors (or GGUF) headers.
    """

    ref: ModelRef
    repo_id: str
    revision: str
    commit: str
    settings: HubSettings
    files: Mapping[str, RemoteFile]
    listing_complete: bool
    local_files: Mapping[str, Path]
    weight_files: tuple[str, ...]
    headers: Mapping[str, Header | GgufHeader]

    @property
    def config_path(self) -> Path | None:
        """Verified local ``config.json`` (``None`` for repos without one, e.g. LoRA adapters)."""
        return self.local_files.get("config.json")

    @property
    def snapshot_dir(self) -> Path:
        """The snapshot folder of :attr:`commit` in the cache (the model's local directory once fetched)."""
        return RepoCache(self.settings.cache_dir, self.repo_id).root / "snapshots" / self.commit


def resolve_metadata(
    ref: ModelRef,
    *,
    cache_dir: str | Path | None = None,
    offline: bool | None = None,
    pinned_commit: str | None = None,
    records_dir: str | Path | None = None,
    on_progress: ProgressCallback | None = None,
    endpoint: str | None = None,
) -> RepoMetadata:
    """Phase one for the hub model ``ref.path@ref.revision`` (``ref.lora`` is ignored: resolve it separately).

    Pins the commit (``pinned_commit`` as-is, for a resume; else the revision's current commit, from the hub or,
    offline or unreachable, from the cache's ``refs/``), lists the repo, fetches and verifies the small files,
    and reads the safetensors headers of the needed shards. ``cache_dir`` is ``--transformers-cache``;
    ``offline`` defaults to ``HF_HUB_OFFLINE``; ``records_dir`` (the resumerge state dir) keeps verification
    records so nothing verified is hashed again.

    Raises ``ValueError`` if ``ref`` is a local path (see :func:`is_local`);
    :class:`ModelInputError` for a bad repo id, an unknown repo/revision/file, a repo without
    safetensors weights, a bad index, or files missing/damaged while offline (naming the repair command);
    :class:`~resumerge.errors.HostileFileError` for escaping paths or lying headers;
    :class:`HubUnavailableError` when the hub is unreachable and the cache cannot stand in;
    :class:`~resumerge.errors.StorageError` when the small files do not fit on the disk.
    """
    settings = hub_settings(cache_dir, offline, endpoint)
    emit = callback_or_noop(on_progress)
    repo_id = _check_repo_id(ref)
    revision = ref.revision or "main"
    repo = RepoCache(settings.cache_dir, repo_id)
    settings, commit = pin_commit(settings, repo, revision, pinned_commit, emit)
    settings, files, complete = commit_files(settings, repo, commit, emit)
    small = small_files(files)
    with VerifyRecords(records_dir) as records:
        local = ensure_files(settings, repo, commit, small, records, emit)
    weights = select_weights(settings, repo, commit, files, complete, local)
    pickled = [name for name in weights if is_pickle_checkpoint(name)]
    headers = read_shard_headers(settings, repo, commit, [files[name] for name in weights if name not in pickled])
    if pickled:  # a pickle has no header to range-read: fetched whole, then indexed by the weights-only loader
        with VerifyRecords(records_dir) as records:
            fetched = ensure_files(settings, repo, commit, [files[name] for name in pickled], records, emit)
        headers.update({name: read_bin_header(fetched[name]) for name in pickled})
    return RepoMetadata(ref, repo_id, revision, commit, settings, files, complete, local, weights, headers)


def fetch_weights(
    meta: RepoMetadata,
    files: Iterable[str] | None = None,
    *,
    records_dir: str | Path | None = None,
    on_progress: ProgressCallback | None = None,
) -> dict[str, Path]:
    """Phase two: make ``files`` (default: ``meta.weight_files``) present and verified; return their paths.

    Downloads only what is missing or damaged, at ``meta.commit``, after checking that the disk has room for
    all of it; continues partial downloads of an interrupted run, and starts a new one from the header bytes
    ``meta.headers`` holds (read by range in phase one: not fetched twice). Returns ``{repo path: snapshot path}``.
    Raises :class:`~resumerge.errors.StorageError` (not enough space, with the numbers), :class:`ModelInputError`
    (unknown file; missing or damaged while offline, with the repair command), :class:`HubUnavailableError`
    (transfer failed after retries; the next run continues it), and
    :class:`~resumerge.inputs.hub.headercheck.HubHeaderChanged` for a verified file that does not start with the
    header in ``meta.headers`` (the one the merge was planned from).
    """
    names = list(meta.weight_files if files is None else files)
    unknown = [name for name in names if name not in meta.files]
    if unknown:
        raise ModelInputError(f"{meta.repo_id}@{meta.commit[:12]} has no file(s) {', '.join(unknown)}")
    repo = RepoCache(meta.settings.cache_dir, meta.repo_id)
    with VerifyRecords(records_dir) as records:
        wanted = [meta.files[name] for name in names]
        prefixes = {name: known_prefix(meta.headers[name]) for name in names if name in meta.headers}
        paths = ensure_files(meta.settings, repo, meta.commit, wanted, records, callback_or_noop(on_progress),
                             prefixes)
    for name, path in paths.items():
        if name in meta.headers:  # the header the plan was made from must be the verified file's
            check_header(path, meta.headers[name], f"{meta.repo_id}@{meta.commit[:12]}/{name}")
    return paths


def _check_repo_id(ref: ModelRef) -> str:
    if is_local(ref):
        raise ValueError(f"{ref.path!r} exists on disk: open it as a local model, not through the hub")
    relative = "" if os.path.isabs(os.path.expanduser(ref.path)) else f" (relative to {os.getcwd()})"
    near = near_folder(ref.path)
    try:
        validate_repo_id(ref.path)
    except ValueError:
        # Not a hub id either, so it was meant as a path: huggingface_hub's wording ("Repo id must be in the
        # form …") would only mislead.
        raise ModelInputError(f"no such directory: {ref.path!r}{relative}",
                              hint=f"did you mean {near!r}?" if near else
                              "check the path; a hub model is named like org/name") from None
    if near is not None:  # a typo of a local folder's name, not a hub repo: said before the hub is asked
        raise ModelInputError(f"no local folder {ref.path!r} exists{relative}", hint=f"did you mean {near!r}?")
    return ref.path


def pin_commit(
    settings: HubSettings, repo: RepoCache, revision: str, pinned: str | None, emit: ProgressCallback
) -> tuple[HubSettings, str]:
    """Return the commit to use, and the settings (switched to offline if the hub proved unreachable)."""
    name = f"{repo.repo_id}@{revision}"
    if pinned is not None:
        if not COMMIT_RE.match(pinned):
            raise ValueError(f"pinned_commit must be a 40-hex commit sha, not {pinned!r}")
        note = "" if pinned == revision else f", even if {revision} has moved since"
        emit(HubEvent("pinned", repo.repo_id, f"{name}: using commit {pinned[:12]} pinned at the start{note}",
                      commit=pinned))
        return settings, pinned
    if COMMIT_RE.match(revision):
        return settings, revision
    asking = settings
    settings, commit = _asked(settings, repo, emit, lambda: resolve_revision(asking, repo.repo_id, revision))
    if commit is not None:
        repo.write_ref(revision, commit)
        emit(HubEvent("resolve", repo.repo_id, f"{name} is commit {commit[:12]}", commit=commit))
        return settings, commit
    cached = repo.read_ref(revision)
    if cached is None:
        raise _not_cached(settings, repo, name)
    emit(HubEvent("resolve", repo.repo_id, f"{name} is commit {cached[:12]} (from the cache)", commit=cached))
    return settings, cached


def commit_files(
    settings: HubSettings, repo: RepoCache, commit: str, emit: ProgressCallback
) -> tuple[HubSettings, dict[str, RemoteFile], bool]:
    """Return the commit's file list (cache first, then the hub, then the snapshot folder) and completeness."""
    files = repo.read_tree(commit)
    if files is not None:
        return settings, files, True
    asking = settings
    settings, files = _asked(settings, repo, emit, lambda: list_files(asking, repo.repo_id, commit))
    if files is not None:
        repo.write_tree(commit, files)
        return settings, files, True
    files = repo.scan_snapshot(commit)
    if not files:
        raise _not_cached(settings, repo, f"{repo.repo_id}@{commit}")
    return settings, files, False


def _not_cached(settings: HubSettings, repo: RepoCache, name: str) -> ResumergeError:
    """The error for ``name`` (of ``repo``) that neither the hub nor its cache answers: first, where the id's
    parent is a local folder, that no local folder of that name exists (it was likely meant as a path)."""
    local = f"no local folder {repo.repo_id!r} exists, " if local_parent(repo.repo_id) else ""
    if settings.unreachable:
        return HubUnavailableError(f"{local}cannot reach {settings.endpoint}, and {name} is not in the hub cache")
    return ModelInputError(
        f"{local}{name} is not in the hub cache {settings.cache_dir}, and offline mode is on",
        hint="run once without HF_HUB_OFFLINE=1 so the model can be fetched",
    )


def _asked(settings: HubSettings, repo: RepoCache, emit: ProgressCallback,
           ask: Callable[[], _T]) -> tuple[HubSettings, _T | None]:
    """What ``ask`` gets from the hub, with the settings; None unless online, or where the hub proved unreachable
    (the settings then offline for the rest of the run: :func:`_fall_back`)."""
    if settings.offline:
        return settings, None
    try:
        return settings, ask()
    except Exception as e:
        if not is_network_error(e):
            raise
        return _fall_back(settings, repo, f"cannot reach {settings.endpoint} ({e})", emit), None


def _fall_back(settings: HubSettings, repo: RepoCache, why: str, emit: ProgressCallback) -> HubSettings:
    """Note that the hub did not answer and treat the rest of this call as offline."""
    emit(HubEvent("fallback", repo.repo_id, f"{why}; using the hub cache"))
    return dataclasses.replace(settings, offline=True, unreachable=True)

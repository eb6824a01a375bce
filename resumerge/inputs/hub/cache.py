"""The huggingface_hub cache as resumerge uses it: settings read at call time, one repo's folders, file lists.

Layout (``models--org--name/``): ``refs/<branch>`` holds a commit, ``blobs/<etag>`` the contents (the etag is
the sha256 of an LFS file or the git blob sha1 of a small one), ``snapshots/<commit>/<path>`` links to a blob,
``trees/<commit>.json`` lists a commit's files (huggingface_hub >= 1.22 writes and reads it; resumerge writes it
in the same format so an offline run knows every file's size and hash).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub import constants

from resumerge.config.locations import replace_text
from resumerge.errors import HostileFileError

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_TREE_FORMAT = 1
_TRUE = frozenset({"1", "on", "yes", "true"})


@dataclass(frozen=True)
class HubSettings:
    """Where the cache is, whether the network may be used, and which hub to ask.

    Read from the environment at call time (huggingface_hub reads it once at import), so ``HF_HUB_CACHE``,
    ``HF_HOME``, ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` set later in the process still count.
    """


    cache_dir: Path
    offline: bool
    endpoint: str
    unreachable: bool = False  # offline because the hub did not answer during this call, not by choice


def hub_settings(
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    endpoint: str | None = None,
) -> HubSettings:
    """Return the settings for one resolution; explicit arguments win over the environment.

    ``cache_dir`` is mergekit's ``--transformers-cache``; without it ``HF_HUB_CACHE``, then ``HF_HOME/hub``,
    then huggingface_hub's own default apply.
    """
    if offline is None:
        flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
        offline = flag.strip().lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)
    if endpoint is None:
        endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    path = default_cache_dir() if cache_dir is None else _normalise(cache_dir)
    return HubSettings(cache_dir=path, offline=offline, endpoint=endpoint.rstrip("/"))


def default_cache_dir() -> Path:
    """The cache huggingface_hub would use now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else its default."""
    env_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    env_home = os.environ.get("HF_HOME")
    if env_cache:
        return _normalise(env_cache)
    if env_home:
        return _normalise(os.path.join(env_home, "hub"))
    return _normalise(constants.HF_HUB_CACHE)


def _normalise(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.expandvars(os.fspath(path))).expanduser().resolve()


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, with the hub's checksum for it.

    ``sha256`` is set for LFS files (and is then the blob name); otherwise ``blob_id`` (the git blob sha1) is the
    checksum and the blob name. ``size`` is ``None`` only for files listed from a snapshot folder offline.
    """

    path: str
    size: int | None
    blob_id: str
    sha256: str | None = None

    @property
    def etag(self) -> str:
        """The blob name in the cache."""
        return self.sha256 or self.blob_id

    @property
    def algorithm(self) -> str:
        """``sha256`` or ``git-sha1``: how the content is checked against :attr:`etag`."""
        return "sha256" if self.sha256 else "git-sha1"


def check_repo_path(path: str, repo_id: str) -> str:
    """Return ``path`` if it is a safe relative path inside a repo; raise HostileFileError otherwise."""
    pure = PurePosixPath(path)
    if not path or "\\" in path or pure.is_absolute() or ".." in pure.parts or "\0" in path:
        raise HostileFileError(
            f"{repo_id} lists a file named {path!r}, which would escape the model folder; refused",
            hint="check the repo id; a well-formed repo never names such a file",
        )
    return path


class RepoCache:
    """The cache folder of one model repo (``<cache>/models--org--name``); nothing is created until written."""

    def __init__(self, cache_dir: Path, repo_id: str) -> None:
        self.cache_dir = cache_dir
        self.repo_id = repo_id
        self.root = cache_dir / ("models--" + repo_id.replace("/", "--"))

    def snapshot(self, commit: str, path: str) -> Path:
        """The snapshot entry of ``path`` at ``commit`` (a link to a blob, or a copy without symlinks)."""
        return self.root / "snapshots" / commit / path

    def blob(self, etag: str) -> Path:
        """The blob file named ``etag``."""
        return self.root / "blobs" / etag

    def lock(self, etag: str) -> Path:
        """The lock file huggingface_hub takes while writing blob ``etag``; resumerge takes the same one."""
        return self.cache_dir / ".locks" / self.root.name / f"{etag}.lock"

    def read_ref(self, revision: str) -> str | None:
        """The commit the cache last saw for branch or tag ``revision``, or ``None``."""
        try:
            commit = (self.root / "refs" / revision).read_text().strip()
        except (OSError, UnicodeDecodeError):
            return None
        return commit if COMMIT_RE.match(commit) else None

    def write_ref(self, revision: str, commit: str) -> None:
        """Record that ``revision`` pointed at ``commit``, as huggingface_hub does after a lookup."""
        if COMMIT_RE.match(revision) or ".." in PurePosixPath(revision).parts:
            return
        replace_text(self.root / "refs" / revision, commit)

    def read_tree(self, commit: str) -> dict[str, RemoteFile] | None:
        """The file list of ``commit`` from ``trees/<commit>.json``; ``None`` if absent, foreign or unreadable."""
        try:
            data = json.loads((self.root / "trees" / f"{commit}.json").read_text(encoding="utf-8"))
            if data.get("format_version") != _TREE_FORMAT:
                return None
            files = {}
            for path, info in data["files"].items():
                sha = info.get("lfs_sha256")
                size = info["lfs_size"] if sha else info["size"]
                files[check_repo_path(path, self.repo_id)] = RemoteFile(path, int(size), info["blob_id"], sha)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # A torn or foreign tree file is not fatal: the listing is fetched again (or rebuilt offline).
            return None
        return files

    def write_tree(self, commit: str, files: Mapping[str, RemoteFile]) -> None:
        """Write ``trees/<commit>.json`` in huggingface_hub's format (a commit never changes, so never stale)."""
        entries: dict[str, dict[str, object]] = {}
        for path in sorted(files):
            f = files[path]
            info: dict[str, object] = {"size": f.size, "blob_id": f.blob_id}
            if f.sha256:
                info["lfs_sha256"] = f.sha256
                info["lfs_size"] = f.size
            entries[path] = info
        replace_text(
            self.root / "trees" / f"{commit}.json",
            json.dumps({"format_version": _TREE_FORMAT, "files": entries}, indent=1),
        )

    def scan_snapshot(self, commit: str) -> dict[str, RemoteFile]:
        """List ``snapshots/<commit>`` when no tree file exists (offline, older caches).

        Only files linked to a blob whose name is a hash can be checked, so only those are listed; the hash
        comes from the blob name (64 hex: sha256, 40 hex: git sha1), the size is unknown.
        """
        base = self.root / "snapshots" / commit
        files: dict[str, RemoteFile] = {}
        for dirpath, _dirs, names in os.walk(base):
            for name in names:
                entry = Path(dirpath) / name
                if not entry.is_symlink():
                    continue
                etag = Path(os.readlink(entry)).name
                rel = entry.relative_to(base).as_posix()
                if _SHA256_RE.match(etag):
                    files[rel] = RemoteFile(rel, None, "", etag)
                elif COMMIT_RE.match(etag):
                    files[rel] = RemoteFile(rel, None, etag)
        return files

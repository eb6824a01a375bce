"""Which files of a repo a merge needs: small files (configs, tokenizer, index) and the weight shards.

Only safetensors are ever fetched: never ``*.bin`` (pickles are never loaded), GGUF, ONNX, Flax or TF files,
nor safetensors the index does not name (e.g. ``original/`` or ``consolidated.safetensors`` copies).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path

from resumerge.errors import ModelInputError
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache, check_repo_path
from resumerge.inputs.hub.fetch import offline_error

# Top-level files a merge reads besides the weights: configs, index, tokenizer, chat template, tagalong JSON.
SMALL_FILE_PATTERNS = (
    "*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja", "spiece.model",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def small_files(files: Mapping[str, RemoteFile]) -> list[RemoteFile]:
    """The top-level configs, index, tokenizer and chat-template files of ``files``, in path order."""
    return [files[p] for p in sorted(files) if "/" not in p and _is_small(p)]


def _is_small(path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in SMALL_FILE_PATTERNS)


def select_weights(
    settings: HubSettings,
    repo: RepoCache,
    commit: str,
    files: Mapping[str, RemoteFile],
    complete: bool,
    local: Mapping[str, Path],
) -> tuple[str, ...]:
    """The shards the merge needs: those named by the safetensors index(es), else every top-level one.

    ``local`` maps the fetched small files to their paths (the index is read from there). Raises
    :class:`ModelInputError` for an unreadable index, shards the repo lacks, or a repo without safetensors;
    :class:`~resumerge.errors.HostileFileError` for an index entry escaping the repo; offline, the error for
    shards not in the cache.
    """
    where = f"{repo.repo_id}@{commit[:12]}"
    indexes = sorted(p for p in local if p.endswith(".safetensors.index.json"))
    names: set[str] = set()
    for index in indexes:
        try:
            weight_map = json.loads(local[index].read_text(encoding="utf-8"))["weight_map"]
            shards = {check_repo_path(str(v), repo.repo_id) for v in weight_map.values()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelInputError(f"{where}: {index} is not a safetensors index ({e})") from e
        names |= shards
    if not indexes:
        names = {p for p in files if "/" not in p and p.endswith(".safetensors")}
    missing = sorted(n for n in names if n not in files)
    if missing and complete:
        raise ModelInputError(f"{where}: the index names shard(s) the repo does not have: {', '.join(missing)}")
    if missing:
        raise offline_error(settings, repo, commit, [(RemoteFile(n, None, ""), "missing") for n in missing])
    if names:
        return tuple(sorted(names))
    if any(p.endswith(_PICKLE_SUFFIXES) for p in files):
        raise ModelInputError(
            f"{where} has only pickled weights (*.bin / *.pt), which resumerge never loads",
            hint="pick a revision with *.safetensors weights (many repos have one under refs/pr/N) or convert them",
        )
    raise ModelInputError(f"{where} has no *.safetensors weights")

"""Which files of a repo a merge needs: small files (configs, tokenizer, index) and the weight shards.

Safetensors when the repo has any (never a ``*.bin`` beside them, nor safetensors the index does not name, e.g.
``original/`` or ``consolidated.safetensors`` copies); only a repo without safetensors gets its
``pytorch_model.bin`` (or the shards ``pytorch_model.bin.index.json`` names) fetched, to be read through PyTorch's
weights-only loader (:mod:`resumerge.inputs.torch_bin`). Never GGUF, ONNX, Flax, TF files or other pickles
(``training_args.bin``, ``optimizer.pt``).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from pathlib import Path

from resumerge.errors import HostileFileError, ModelInputError
from resumerge.inputs.hub.cache import HubSettings, RemoteFile, RepoCache, check_repo_path
from resumerge.inputs.hub.fetch import offline_error
from resumerge.inputs.torch_bin import BIN_INDEX_NAME, BIN_SINGLE_NAME, refuse_unsafe_unpickler

# Top-level files a merge reads besides the weights: configs, index, tokenizer, chat template, tagalong JSON.
SMALL_FILE_PATTERNS = (
    "*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja", "spiece.model",
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def _bin_weights(where: str, repo: RepoCache, files: Mapping[str, RemoteFile],
                 local: Mapping[str, Path]) -> tuple[str, ...]:
    """The ``.bin`` shards of a repo without safetensors: those its ``.bin`` index names, else
    ``pytorch_model.bin``; () when it has neither."""
    index = local.get(BIN_INDEX_NAME)
    if index is None:
        return (BIN_SINGLE_NAME,) if BIN_SINGLE_NAME in files else ()
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = {check_repo_path(str(v), repo.repo_id) for v in weight_map.values()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelInputError(f"{where}: {BIN_INDEX_NAME} is not a checkpoint index ({e})") from e
    odd = sorted(s for s in shards if not s.endswith(".bin") or "/" in s)
    if odd:
        raise HostileFileError(f"{where}: {BIN_INDEX_NAME} names files that are not .bin shards: {', '.join(odd)}")
    missing = sorted(s for s in shards if s not in files)
    if missing:
        raise ModelInputError(f"{where}: {BIN_INDEX_NAME} names shard(s) the repo does not have: {', '.join(missing)}")
    return tuple(sorted(shards))


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
    pickled = _bin_weights(where, repo, files, local)
    if pickled:
        refuse_unsafe_unpickler(pickled[0], where)  # before a byte of it is downloaded
        return pickled
    if any(p.endswith(_PICKLE_SUFFIXES) for p in files):
        raise ModelInputError(
            f"{where} has pickled weights but no pytorch_model.bin (or pytorch_model.bin.index.json), the only "
            "pickled checkpoints resumerge reads",
            hint="pick a revision with *.safetensors weights (many repos have one under refs/pr/N) or convert them",
        )
    raise ModelInputError(f"{where} has no *.safetensors weights")

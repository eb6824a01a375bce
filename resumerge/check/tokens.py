"""A check's token sequences, remembered in the state dir: a resumed check (or the same check asked again) does not
load the tokenizer again to find which check it is.

Loading the tokenizer (transformers' ``AutoTokenizer``) is one of the costs a killed and resumed check pays twice,
1-2.4 s of a resume on the shared bench machine (bench/RESULTS.md, issue 57). The sequences are kept under a key of
everything they depend on: each candidate folder's path and its files other than weights (name, size, modification
time: a changed tokenizer or template is a new key), the prompts (the built-in texts, or the file's bytes), and the
versions of transformers, tokenizers and resumerge. Anything unreadable is computed again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from collections.abc import Sequence
from pathlib import Path

from resumerge.check.prompts import BUILT_IN, load_tokenizer, sequences
from resumerge.store.durable import write_file_atomic

TOKENS_DIR = "tokens"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".npz")


def cached_sequences(directories: Sequence[Path], prompts_file: Path | None, cache: Path) -> list[list[int]]:
    """:func:`~resumerge.check.prompts.sequences` of the tokenizer :func:`~resumerge.check.prompts.load_tokenizer`
    finds in ``directories``, kept under ``cache`` (the state dir's checks folder) and read from there when
    nothing they depend on changed."""
    key = _key(directories, prompts_file)
    path = cache / TOKENS_DIR / f"{key}.json" if key is not None else None
    if path is not None:
        found = _read(path)
        if found is not None:
            return found
    tokens = sequences(load_tokenizer(directories), prompts_file)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(path, json.dumps(tokens).encode())
        except OSError:  # a read-only state dir: the check runs all the same
            pass
    return tokens


def _key(directories: Sequence[Path], prompts_file: Path | None) -> str | None:
    """What the sequences depend on, hashed; None when it cannot be known (then nothing is kept)."""
    try:
        folders = [[os.path.abspath(d), sorted([e.name, e.stat().st_size, e.stat().st_mtime_ns]
                                                for e in os.scandir(d) if e.is_file()
                                                and not e.name.endswith(_WEIGHTS))]
                   for d in directories]
        prompts = (hashlib.sha256(prompts_file.read_bytes()).hexdigest() if prompts_file is not None
                   else [list(pair) for pair in BUILT_IN])
    except OSError:  # sequences() says what is wrong with the prompts file
        return None
    versions: list[str | None] = []
    for dist in ("transformers", "tokenizers", "resumerge"):
        try:
            versions.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            versions.append(None)
    return hashlib.sha256(json.dumps([folders, prompts, versions]).encode()).hexdigest()[:32]


def _read(path: Path) -> list[list[int]] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(doc, list) or not doc
            or not all(isinstance(s, list) and len(s) >= 2 and all(type(i) is int for i in s) for s in doc)):
        return None
    return doc

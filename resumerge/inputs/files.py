"""The files of a model directory, as data from the internet: their names, content identities, and the check
that a name stays inside its directory.

Shared by everything that opens a model folder (a local model, a hub snapshot, a LoRA adapter) and by the
outputs, which write files of the same names.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from resumerge.errors import HostileFileError
from resumerge.inputs.safetensors_format import TensorEntry

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# What the tokenizer donor contributes (mergekit's fast-path list, plus vocab.json that GPT-2-style BPE needs).
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    # A VLM's image/video processor settings travel with its tokenizer (mergekit's tagalong files).
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


_SAMPLE_BLOCKS = 16
_SAMPLE_SIZE = 64 * 1024


@dataclass(frozen=True)
class InputFile:
    """A weight file of an input model: name relative to the model directory, size, content identity."""

    name: str
    size: int
    identity: str
    # (size, mtime_ns) of the local file when it was opened, before its header was read (None: not a local file):
    # what the run checks it against, so a file re-saved while the merge was being planned is never merged from.
    # Not part of the identity.
    seen: tuple[int, int] | None = field(default=None, compare=False)


class TensorSource(NamedTuple):
    """Where one input tensor lives: file name (relative), its header entry. A tuple: a checkpoint's headers make
    92k of them, at a fifth of a frozen dataclass's cost each."""

    file: str
    entry: TensorEntry


def file_look(path: Path) -> tuple[int, int]:
    """(size, mtime_ns) of the file at ``path``: how it looks, without reading it."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def file_identity(path: Path, header_raw: bytes) -> str:
    """A content identity of a weight file: sha256 over its size, header and 16 evenly spaced 64 KiB blocks.

    Reads about 1 MiB whatever the file size; any re-trained or re-quantised model differs in all of these.
    """
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(str(size).encode())
    digest.update(header_raw)
    with open(path, "rb") as f:
        for k in range(_SAMPLE_BLOCKS):
            offset = (size - _SAMPLE_SIZE) * k // max(1, _SAMPLE_BLOCKS - 1) if size > _SAMPLE_SIZE else 0
            digest.update(os.pread(f.fileno(), _SAMPLE_SIZE, max(0, offset)))
    return digest.hexdigest()


def tokenizer_files(directory: Path) -> tuple[tuple[str, str], ...]:
    """(name, sha256) of the tokenizer files present in ``directory``, in a fixed order."""
    found = []
    for name in TOKENIZER_FILES:
        path = directory / name
        if path.is_file():
            found.append((name, hashlib.sha256(path.read_bytes()).hexdigest()))
    return tuple(found)


def contained(directory: Path, name: str) -> Path:
    """``directory / name``, a file that may be copied into OUT as it is (config.json, a tokenizer or template
    file); raises :class:`HostileFileError` when it is a symbolic link leading outside.

    A model folder is data from the internet: a link such as ``tokenizer.json -> ~/.ssh/id_rsa`` or
    ``config.json -> ~/.docker/config.json`` would copy a private file into OUT. Links that stay inside the
    folder are fine, and so are a Hugging Face cache snapshot's links (``snapshots/<commit>/x ->
    ../../blobs/<sha>``) into that repository's ``blobs`` folder. Weights are read with :func:`followed`.
    """
    path = directory / name
    if not path.is_symlink():
        return path
    target = _target(directory, name)
    roots = [directory.resolve()]
    if directory.parent.name == "snapshots":
        roots.append((directory.parent.parent / "blobs").resolve())
    if any(root in target.parents for root in roots):
        return path
    raise HostileFileError(
        f"{name} is a symbolic link to {target}, outside the model directory",
        path=str(path),
        hint="refusing to read it; copy the file into the model directory if it is really part of the model",
    )


def followed(directory: Path, name: str) -> Path:
    """``directory / name``, a file read but never copied into OUT (a weight file or its index, read as tensors
    and names; any file of a model an analysis only reads): a symbolic link is followed wherever it leads — a
    folder of links to weights kept elsewhere is how people avoid copying 15 GB, and what ``huggingface-cli
    download --local-dir`` made before huggingface_hub 0.23. Its bytes reach OUT only as tensors a header
    describes, so a link to a private file is refused as a damaged weight file, never copied. Raises
    :class:`HostileFileError` for a link loop only."""
    path = directory / name
    if path.is_symlink():
        _target(directory, name)
    return path


def _target(directory: Path, name: str) -> Path:
    """Where the link ``directory / name`` leads; :class:`HostileFileError` for a link loop."""
    path = directory / name
    try:
        return path.resolve(strict=False)
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13)
        raise HostileFileError(f"{name} is a symbolic link loop", path=str(path)) from None

"""A GGUF model as a model folder: what the code that reads a model's folder (transformers' config and tokenizer,
the forward engine) needs beside the weights, rebuilt from the file's metadata.

A GGUF carries its config and tokenizer in its metadata, never as files beside it. ``resumerge check`` and the
mergekit-moe prompt pass build the model's modules from ``config.json`` and read the prompts with its tokenizer, so
a GGUF model is given a folder of its own under the state dir (never beside the user's file): ``config.json`` as a
safetensors output of it gets it (the synthesized config without the GGUF codec's ``quantization_config``), the
tokenizer files transformers rebuilds from the metadata (:func:`~.tokenizer.gguf_tokenizer_files`, as a safetensors
output's tokenizer is made), and a link to each of its files, so its tensors are at the same names in the folder
as in the GGUF's own. Named by the files' path and identities and the transformers version (the tokenizer's bytes
are its), it is made once (in a temporary folder renamed into place) and found again after.

A GGUF whose tokenizer transformers cannot rebuild gets a folder without one (:func:`tokenizer_error` says why): a
check then reads the prompts with another checked model's tokenizer (or names the reason when none has one), and
MoE upcycling refuses it where it needs the tokenizer (the prompt gate modes, the output's tokenizer files).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.errors import ModelInputError, StorageError

if TYPE_CHECKING:
    from resumerge.inputs.model import ModelInput

# The folder's layout; a change here names new folders.
_LAYOUT = 1
TOKENIZER_ERROR = "tokenizer-error.txt"


def gguf_folder(model: ModelInput, root: Path) -> Path:
    """The folder of GGUF model input ``model`` (opened from its file: ``model.gguf`` set) under ``root``, made
    when it is not there yet."""
    if model.gguf is None:
        raise ValueError(f"{model.ref.key} is not a GGUF model")
    path = (model.directory / model.gguf).resolve()
    folder = root / _name(path, model)
    if (folder / "config.json").is_file():
        return folder
    building = root / f".{folder.name}.{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    try:
        _build(model, path, building, folder)
    except OSError as exc:  # a full or read-only state dir, a filesystem without links
        raise StorageError(f"cannot make the folder of GGUF model {path} in the state dir: {exc}",
                           path=str(folder), hint="give a --state-dir on a writable local filesystem") from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder


def _build(model: ModelInput, path: Path, building: Path, folder: Path) -> None:
    """Write the folder's files into ``building``, then rename it to ``folder``."""
    building.mkdir(parents=True)
    config = {k: v for k, v in model.config.items() if k != "quantization_config"}
    files = {"config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}
    try:
        from resumerge.inputs.gguf.tokenizer import gguf_tokenizer_files

        files.update(gguf_tokenizer_files(path, model.gguf_header))
    except ModelInputError as exc:
        files[TOKENIZER_ERROR] = (exc.message + "\n").encode()
    for name, data in files.items():
        (building / name).write_bytes(data)
    for file in model.files:  # the weights, at the names the model's tensors give (a hub GGUF's: its repo paths)
        link = building / file.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(model.directory.resolve() / file.name)
    try:
        building.rename(folder)
    except OSError:  # another process made it meanwhile
        if not (folder / "config.json").is_file():
            raise


def tokenizer_error(folder: Path) -> str | None:
    """Why the folder has no tokenizer (None: it has one)."""
    found = folder / TOKENIZER_ERROR
    return found.read_text(encoding="utf-8").strip() if found.is_file() else None


def _name(path: Path, model: ModelInput) -> str:
    try:
        version: str | None = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    doc = [_LAYOUT, str(path), [[f.name, f.size, f.identity] for f in model.files], version]
    return f"{path.stem[:40]}-{hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]}"

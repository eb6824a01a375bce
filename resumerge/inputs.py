"""Open a model input without reading weights: config.json, the index, every safetensors header.

Hostile files are refused here: index entries that escape the model directory, headers that lie about sizes
(see :mod:`resumerge.safetensors_format`), pickle-only checkpoints (never unpickled). Each input file also gets a
cheap content identity (size, header hash, hash of sampled blocks) that survives copies and re-downloads —
unlike mtimes — so a resume can tell whether an input changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.errors import HostileFileError, ModelInputError, PlanChangedError
from resumerge.modelref import ModelRef
from resumerge.outputs import TOKENIZER_FILES
from resumerge.safetensors_format import TensorEntry, read_header

if TYPE_CHECKING:
    from resumerge.adapters import Adapter

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_SAMPLE_BLOCKS = 16
_SAMPLE_SIZE = 64 * 1024


@dataclass(frozen=True)
class InputFile:
    """A weight file of an input model: name relative to the model directory, size, content identity."""

    name: str
    size: int
    identity: str


@dataclass(frozen=True)
class TensorSource:
    """Where one input tensor lives: file name (relative), its header entry."""

    file: str
    entry: TensorEntry


@dataclass(frozen=True)
class ModelInput:
    """A model input opened for planning: its config, every tensor's location, its weight files."""

    ref: ModelRef
    directory: Path
    config: Mapping[str, Any]
    tensors: Mapping[str, TensorSource]
    files: tuple[InputFile, ...]
    # The LoRA adapter of a ``model+adapter`` reference, applied tensor by tensor while merging.
    adapter: Adapter | None = None


def open_model(ref: ModelRef, *, yaml_path: str = "", directory: Path | None = None) -> ModelInput:
    """Open the local model ``ref`` (reading only config.json, the index and headers).

    ``directory`` overrides where the model is (a resume uses the directory recorded at planning); otherwise
    ``ref.path`` is used, relative to the current directory, and recorded as an absolute path. Raises
    :class:`ModelInputError` for a missing directory, config or weights, and :class:`HostileFileError` for files
    that try to escape the directory or whose headers are inconsistent.
    """
    if ref.lora is not None:
        raise ModelInputError(
            f"LoRA adapter references ({ref.key}) are not supported by this version",
            yaml_path=yaml_path,
            hint="merge the adapter into its base first (PEFT merge_and_unload) and reference that folder",
        )
    directory = (directory or Path(ref.path)).absolute()
    if not directory.is_dir():
        raise ModelInputError(
            f"model {ref.path!r} not found: no such directory",
            yaml_path=yaml_path,
            hint="check the path; Hugging Face Hub ids are not supported by this version",
        )
    for name in ("config.json", INDEX_NAME, *TOKENIZER_FILES):
        contained(directory, name)
    config = _read_config(directory, yaml_path)
    names = _weight_files(directory, yaml_path)
    tensors: dict[str, TensorSource] = {}
    files = []
    for name in names:
        path = contained(directory, name)
        header = read_header(path)
        for tname, entry in header.tensors.items():
            if tname in tensors:
                raise HostileFileError(
                    f"tensor {tname!r} appears in both {tensors[tname].file} and {name}", path=str(directory)
                )
            tensors[tname] = TensorSource(name, entry)
        files.append(InputFile(name, header.file_size, file_identity(path, header.raw)))
    return ModelInput(ref, directory, config, tensors, tuple(files))


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


def _read_config(directory: Path, yaml_path: str) -> Mapping[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelInputError(f"{directory} has no config.json", yaml_path=yaml_path, path=str(path))
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelInputError(f"config.json is not valid JSON ({exc})", path=str(path)) from None
    if not isinstance(config, dict):
        raise ModelInputError("config.json must hold a JSON object", path=str(path))
    return config


def _weight_files(directory: Path, yaml_path: str) -> list[str]:
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ModelInputError(f"index is not valid JSON ({exc})", path=str(index)) from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelInputError("index has no weight_map", path=str(index))
        names = sorted({_safe_name(v, index) for v in weight_map.values()})
        for name in names:
            if not (directory / name).is_file():
                raise ModelInputError(
                    f"index names {name} but the file is missing", path=str(index), hint="re-download the model"
                )
        return names
    if (directory / SINGLE_NAME).is_file():
        return [SINGLE_NAME]
    singles = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if len(singles) == 1:
        return singles
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise ModelInputError(
            f"{directory} has only pickle weights (.bin/.pt); resumerge never unpickles files",
            yaml_path=yaml_path,
            hint="convert the model to safetensors first",
        )
    raise ModelInputError(f"Unable to find model files at {directory}", yaml_path=yaml_path)


def _safe_name(value: object, index: Path) -> str:
    # An index is data from the internet: a weight_map value must name a plain file beside the index.
    if (
        not isinstance(value, str)
        or not value
        or value in {".", ".."}
        or "/" in value
        or "\\" in value
        or "\x00" in value
        or os.path.isabs(value)
    ):
        raise HostileFileError(
            f"index weight_map entry {value!r} escapes the model directory", path=str(index), hint="refusing to read it"
        )
    if not value.endswith(".safetensors"):
        raise HostileFileError(f"index weight_map entry {value!r} is not a .safetensors file", path=str(index))
    return value


def contained(directory: Path, name: str) -> Path:
    """``directory / name``; raises :class:`HostileFileError` when it is a symbolic link leading outside.

    A model folder is data from the internet: a link such as ``tokenizer.json -> ~/.ssh/id_rsa`` or
    ``config.json -> ~/.docker/config.json`` would copy a private file into OUT. Links that stay inside the
    folder are fine, and so are a Hugging Face cache snapshot's links (``snapshots/<commit>/x ->
    ../../blobs/<sha>``) into that repository's ``blobs`` folder.
    """
    path = directory / name
    if not path.is_symlink():
        return path
    try:
        target = path.resolve()
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13)
        raise HostileFileError(f"{name} is a symbolic link loop", path=str(path)) from None
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


class InputWatch:
    """Notices an input weight file modified in place, replaced or deleted while a merge reads it.

    Taken when the run starts (the plan has just checked every file's content identity). :meth:`check` costs
    one ``stat`` per file and runs before every commit: a file committed after a passing check was computed
    only from bytes read before it, so from unchanged inputs — a change is caught at the first commit after it,
    and the shards committed before it stay valid. Compares size and mtime: not ctime, which a mere chmod moves,
    nor inode numbers, which some FUSE filesystems (Drive) do not keep stable.
    """

    def __init__(self, files: Iterable[Path]) -> None:
        self._seen = {path: _stat_key(path) for path in files}

    @classmethod
    def of(cls, model_dirs: Mapping[str, str], inputs: Mapping[str, Iterable[tuple[str, int, str]]]) -> InputWatch:
        """A watch over every weight file of a plan (``plan.model_dirs`` and ``plan.inputs``)."""
        return cls(Path(model_dirs[key]) / f[0] for key, files in inputs.items() for f in files)

    def changed(self) -> PlanChangedError | None:
        """The error describing the first changed input file, or None when all are as they were."""
        for path, before in self._seen.items():
            now = _stat_key(path)
            if now == before:
                continue
            what = "was deleted" if now is None else "changed"
            return PlanChangedError(
                f"input file {path} {what} during the merge; shards committed before that are kept",
                path=str(path),
                hint="restore it as it was and run resumerge resume OUT (or start over with --restart)",
            )
        return None

    def check(self) -> None:
        """Raise :meth:`changed`'s error, if any."""
        error = self.changed()
        if error is not None:
            raise error


def _stat_key(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns

"""Open a model input without reading weights: config.json, the index, every safetensors header.

Hostile files are refused here: index entries that escape the model directory, headers that lie about sizes
(see :mod:`resumerge.inputs.safetensors_format`), pickle-only checkpoints (never unpickled). Each input file also gets a
cheap content identity (size, header hash, hash of sampled blocks) that survives copies and re-downloads —
unlike mtimes — so a resume can tell whether an input changed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.modelref import ModelRef
from resumerge.errors import HostileFileError, ModelInputError, PlanChangedError
from resumerge.inputs.files import (
    INDEX_NAME,
    SINGLE_NAME,
    TOKENIZER_FILES,
    InputFile,
    TensorSource,
    contained,
    file_identity,
    file_look,
    followed,
)
from resumerge.inputs.quant.refusals import GGUF_MAGIC, refuse_gguf
from resumerge.inputs.safetensors_format import Header, read_header
from resumerge.inputs.torch_bin import BIN_INDEX_NAME, BIN_SINGLE_NAME, is_pickle_checkpoint, read_bin_header

if TYPE_CHECKING:
    from resumerge.inputs.adapters import Adapter
    from resumerge.inputs.codecs import CodecTable, StoredFormats
    from resumerge.inputs.gguf.header import GgufHeader



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
    # The stored formats of its tensors once recognised (then ``tensors`` holds logical tensors: see
    # recognised); None: as opened, every tensor stored plainly under its own name.
    formats: StoredFormats | None = None
    # The GGUF file (in ``directory``; a hub GGUF's path in its repo) the model was read from, or None: its config
    # and tokenizer come from the file's metadata, not from files beside it.
    gguf: str | None = None
    # That file's parsed header: what plan-time readers of its metadata read (a hub GGUF's file is not on disk
    # until the run fetches it, if ever: a streamed one never is).
    gguf_header: GgufHeader | None = field(default=None, compare=False, repr=False)

    def recognised(self, codecs: CodecTable, *, seen: Iterable[ModelInput] = ()) -> ModelInput:
        """This model as the planner sees it: ``tensors`` its logical tensors under ``codecs``' formats, companions
        folded into the tensor they belong to, ``formats`` saying how each is stored. Raises
        :class:`ModelInputError` for a tensor a format cannot read. ``seen``: models recognised under ``codecs``
        before. Formats judge a model by its config.json and its stored tensors' names, dtypes and shapes alone
        (:meth:`~resumerge.inputs.codecs.protocol.TensorDecoder.recognise`), so this one takes the claims and roles
        of one whose config.json and stored tensors' names, dtypes and shapes equal its own (two fine-tunes of one
        base are judged once, however their files are written); its logical tensors stay at its own files and
        offsets, and are the other's own mapping when those are equal too."""
        for other in seen:
            if other.formats is None or other.config != self.config:
                continue
            if other.formats.stored == self.tensors:
                return replace(self, tensors=other.tensors, formats=other.formats)
            if stored_alike(other.formats.stored, self.tensors):
                formats = replace(other.formats, stored=self.tensors)
                return replace(self, tensors=formats.logical(), formats=formats)
        formats = codecs.recognise(self.config, self.tensors, where=str(self.directory))
        return replace(self, tensors=formats.logical(), formats=formats)


def stored_alike(one: Mapping[str, TensorSource], other: Mapping[str, TensorSource]) -> bool:
    """Whether ``one`` and ``other`` (stored tensors by name) hold the same names with the same dtypes and shapes,
    whatever their files and offsets: all a format's recognition reads."""
    if len(one) != len(other) or one.keys() != other.keys():
        return False
    return all(a.entry.dtype == b.entry.dtype and a.entry.shape == b.entry.shape
               for a, b in zip(one.values(), map(other.__getitem__, one)))


def open_model(ref: ModelRef, *, yaml_path: str = "", directory: Path | None = None,
               parsed: dict[tuple[bytes, int], Header] | None = None, copies: bool = True) -> ModelInput:
    """Open the local model ``ref`` (reading only config.json, the index and headers).

    ``directory`` overrides where the model is (a resume uses the directory recorded at planning); otherwise
    ``ref.path`` is used, relative to the current directory, and recorded as an absolute path. ``parsed``: the
    safetensors headers parsed before, shared with the models opened with it (see
    :func:`~resumerge.inputs.safetensors_format.read_header`). Raises
    :class:`ModelInputError` for a missing directory, config or weights, and :class:`HostileFileError` for files
    that try to escape the directory or whose headers are inconsistent. ``copies``: whether its config.json and
    tokenizer files may be copied into an output as they are (a merge), so a symbolic link of theirs leading out
    of the folder is refused (see :func:`~resumerge.inputs.files.contained`); an analysis that writes none of
    them anywhere (check, measure) passes False and follows every link. Weights and indexes are followed either
    way (:func:`~resumerge.inputs.files.followed`). A ``model+adapter`` reference's adapter
    is not read here: :func:`~resumerge.inputs.catalog.open_inputs` opens its base by the reference without it
    and the adapter beside it (MoE experts and recipe stage names refuse adapters in their configs).
    """
    if Path(ref.path).suffix == ".gguf":  # a GGUF file: a resume records its folder
        return _open_gguf(ref, (directory / Path(ref.path).name if directory else Path(ref.path)).absolute())
    directory = (directory or Path(ref.path)).absolute()
    if directory.is_file():  # a model's weights file named instead of its folder
        raise ModelInputError(
            f"model {ref.path!r} is a file: a model is a folder (or a hub id such as org/name), not one of its files",
            yaml_path=yaml_path,
            hint=f"name its folder: {_folder_of(ref.path)}",
        )
    if not directory.is_dir():
        raise ModelInputError(
            f"model {ref.path!r} not found: no such directory",
            yaml_path=yaml_path,
            hint="check the path (a model is a local folder, or a hub id such as org/name)",
        )
    confine = contained if copies else followed
    for name in ("config.json", *TOKENIZER_FILES):
        confine(directory, name)
    for name in (INDEX_NAME, BIN_INDEX_NAME):
        followed(directory, name)
    config = _read_config(directory, yaml_path)
    names = _weight_files(directory, yaml_path)
    tensors: dict[str, TensorSource] = {}
    sizes: list[int] = []
    looks: list[tuple[int, int]] = []
    # Each file's identity (reading and hashing 1 MiB, both without the GIL) is taken on a thread while the next
    # headers are parsed (with it): 163 shards hash 163 MiB, 0.15 s of a core the planning thread need not spend.
    with ThreadPoolExecutor(1, thread_name_prefix="resumerge-identity") as hashing:
        identities = []
        for name in names:
            path = followed(directory, name)
            looks.append(file_look(path))  # before its header: a write after this shows as another look
            header = read_bin_header(path) if is_pickle_checkpoint(name) else read_header(path, parsed=parsed)
            if not tensors.keys().isdisjoint(header.tensors):  # one set operation per file, not a test per tensor
                tname = next(t for t in header.tensors if t in tensors)
                raise HostileFileError(
                    f"tensor {tname!r} appears in both {tensors[tname].file} and {name}", path=str(directory)
                )
            tensors.update(zip(header.tensors, map(TensorSource, repeat(name), header.tensors.values())))
            sizes.append(header.file_size)
            identities.append(hashing.submit(file_identity, path, header.raw))
        files = tuple(map(InputFile, names, sizes, (identity.result() for identity in identities), looks))
    return ModelInput(ref, directory, config, tensors, files)


def _folder_of(path: str) -> str:
    """The folder holding the file ``path``, written as the user wrote the path (``./x/model.safetensors`` →
    ``./x``)."""
    parent = os.path.dirname(path.rstrip("/"))
    return parent or "."


def _open_gguf(ref: ModelRef, path: Path) -> ModelInput:
    """The GGUF file at ``path`` (or the split set it starts) as a model input: its folder is the model's
    directory, its files the model's files, its config and tokenizer rebuilt from its metadata."""
    from resumerge.inputs.gguf.model import open_gguf

    if not path.is_file():
        raise ModelInputError(f"model {str(path)!r} not found: no such GGUF file", hint="check the path")
    found = open_gguf(path)
    files = tuple(InputFile(name, header.file_size, file_identity(path.with_name(name), header.raw))
                  for name, header in found.headers)
    return ModelInput(ref, path.parent, found.config, found.tensors, files, gguf=path.name,
                      gguf_header=found.headers[0][1])


# NVIDIA ModelOpt's statement of how a checkpoint is quantized, beside config.json.
MODELOPT_CONFIG = "hf_quant_config.json"


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
    if "quantization_config" not in config:
        modelopt = _modelopt_settings(directory / MODELOPT_CONFIG)
        if modelopt is not None:
            config["quantization_config"] = modelopt
    return config


def _modelopt_settings(path: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` an NVIDIA ModelOpt export states only in ``hf_quant_config.json`` (older
    exports write none into config.json): its ``quantization`` under ``quant_method: modelopt``, as transformers
    and vLLM read it; None without that file, or when it is not ModelOpt's."""
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelInputError(f"{MODELOPT_CONFIG} is not valid JSON ({exc})", path=str(path)) from None
    settings = found.get("quantization") if isinstance(found, dict) else None
    if not isinstance(settings, dict):
        return None
    return {"quant_method": "modelopt", **settings}


def _weight_files(directory: Path, yaml_path: str) -> list[str]:
    # safetensors first, as mergekit: a folder with both formats is read as safetensors.
    found = _indexed(directory / INDEX_NAME, ".safetensors")
    if found:
        return found
    if (directory / SINGLE_NAME).is_file():
        return [SINGLE_NAME]
    singles = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    if len(singles) == 1:
        return singles
    found = _indexed(directory / BIN_INDEX_NAME, ".bin")
    if found:
        return found
    if followed(directory, BIN_SINGLE_NAME).is_file():
        return [BIN_SINGLE_NAME]
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise ModelInputError(
            f"{directory} has pickle weights resumerge does not recognise (only pytorch_model.bin, or the shards "
            "pytorch_model.bin.index.json names, are read)",
            yaml_path=yaml_path,
            hint="convert the model to safetensors first",
        )
    for gguf in sorted(directory.glob("*.gguf")):
        with followed(directory, gguf.name).open("rb") as file:
            refuse_gguf(file.read(len(GGUF_MAGIC)), str(gguf))
    raise ModelInputError(f"Unable to find model files at {directory}", yaml_path=yaml_path)


def _indexed(index: Path, suffix: str) -> list[str]:
    """The weight files ``index`` names (each checked to exist and end in ``suffix``), or [] without one."""
    directory = index.parent
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ModelInputError(f"index is not valid JSON ({exc})", path=str(index)) from None
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelInputError("index has no weight_map", path=str(index))
        values = weight_map.values()
        try:  # 92k entries name a few hundred files: each checked once, in the order the index first names it
            distinct: Iterable[object] = dict.fromkeys(values)
        except TypeError:  # an unhashable entry: checked in turn, the bad one refused when its turn comes
            distinct = values
        names = sorted({_safe_name(value, index, suffix) for value in distinct})
        for name in names:
            if not (directory / name).is_file():
                raise ModelInputError(
                    f"index names {name} but the file is missing", path=str(index), hint="re-download the model"
                )
        return names
    return []


def _safe_name(value: object, index: Path, suffix: str) -> str:
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
    if not value.endswith(suffix):
        raise HostileFileError(f"index weight_map entry {value!r} is not a {suffix} file", path=str(index))
    return value


class InputWatch:
    """Notices an input weight file modified in place, replaced or deleted while a merge reads it.

    Seeded with how each file looked when the plan opened it (or when the run starts, for a file the plan did not
    open: a thawed plan's, a recipe stage's); the run also proves each file's full content
    (:mod:`resumerge.inputs.contents`) before its first commit. :meth:`check` costs
    one ``stat`` per file and runs before every commit: a file committed after a passing check was computed
    only from bytes read before it, so from unchanged inputs — a change is caught at the first commit after it,
    and the shards committed before it stay valid. Compares size and mtime: not ctime, which a mere chmod moves,
    nor inode numbers, which some FUSE filesystems (Drive) do not keep stable.
    """

    def __init__(self, files: Iterable[Path], seen: Mapping[str, tuple[int, int]] | None = None) -> None:
        known = seen or {}
        self._seen = {path: known.get(str(path)) or _stat_key(path) for path in files}

    @classmethod
    def of(cls, model_dirs: Mapping[str, str], inputs: Mapping[str, Iterable[tuple[str, int, str]]],
           seen: Mapping[str, tuple[int, int]] | None = None) -> InputWatch:
        """A watch over every weight file of a plan (``plan.model_dirs`` and ``plan.inputs``); ``seen``: how files
        looked when they were opened for the plan, by path (:func:`~resumerge.inputs.contents.opened_looks`), so a
        change while the merge was being planned stops it too."""
        return cls((Path(model_dirs[key]) / f[0] for key, files in inputs.items() for f in files), seen)

    def changed(self) -> PlanChangedError | None:
        """The error describing the first changed input file, or None when all are as they were."""
        for path, before in self._seen.items():
            if before is None:
                continue  # not on disk when the run started: a hub file streamed, or downloaded while merging
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

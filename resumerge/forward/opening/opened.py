"""The one opener of a model for a forward pass: a local folder, a hub repo (``hf://NAMESPACE/NAME[@REVISION]``), a
GGUF file or split set, a folder holding one GGUF model, or a GGUF file of a hub repo
(``hf://NAMESPACE/NAME/PATH/FILE.gguf[@REVISION]``), opened from its headers only.

A hub repo's config, tokenizer and safetensors headers are fetched into the Hugging Face cache (as a merge's hub
inputs are) and its weights read by HTTP Range at the commit pinned then, never downloaded whole (``remote``; a
client holds each range to the hub's checksums: :mod:`.hubreads`). A hub input's cache
snapshot that lacks its weights (a merge that streamed it) is read the same way. A GGUF model's tensors are decoded
by the GGUF codec, and its config.json and tokenizer rebuilt from its metadata into a folder of its own under the
state dir (:func:`~resumerge.inputs.gguf.folder.gguf_folder`), which is the model's folder for the pass and its
tokenizer."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.config.hubtarget import SCHEME, is_hub_target, parse_hub_target
from resumerge.config.locations import StateDir
from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError, UsageError
from resumerge.inputs.model import ModelInput, open_model

if TYPE_CHECKING:  # the hub's range reader (its HTTP stack) is imported only for a hub model
    from resumerge.inputs.gguf.header import GgufHeader
    from resumerge.inputs.hub.ranges import StreamedFile
    from resumerge.inputs.hub.stream import StreamedReads
    from resumerge.inputs.safetensors_format import Header

SNAPSHOT = re.compile(r"models--(.+?)--([^/]+)/snapshots/([0-9a-f]{40})/?$")  # a hub cache snapshot's folder
_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")  # a decoder layer's tensor name
_LATER_PART = re.compile(r"-(?!00001)\d{5}-of-\d{5}\.gguf$")  # a split GGUF's second file or later


@dataclass(frozen=True)
class PassModel:
    """One model of a pass (``check`` calls it ``Checked``): its ``role`` (merge, base, parent), where it is, its
    weight in the merge (None: not known), whether it is the merge's own (``own``: its record names it), the model
    opened (headers only) and its weight files read from the hub by range (``remote``), with the headers read of
    them (``headers``: what their checksums are checked with) and, once a client binds them
    (:mod:`.hubreads`), what they are read through (``reads``)."""

    role: str
    path: str
    weight: float | None
    opened: ModelInput
    remote: tuple[StreamedFile, ...] = ()
    headers: Mapping[str, Header | GgufHeader] = field(default_factory=dict, compare=False, repr=False)
    reads: StreamedReads | None = field(default=None, compare=False, repr=False)
    own: bool = True  # the merge's own base or parent (its record names it; True where it has no record)


def open_for_pass(where: str, what: str, state: StateDir, hint: str | None = None) -> PassModel:
    """The model at ``where`` (a folder or ``hf://`` repo; ``what`` names it in errors, ``hint`` says what to do
    where it is gone), opened (headers only)."""
    if is_hub_target(where):
        if ".gguf" in where:
            return _open_hub_gguf(where, what, state)
        return _open_hub(where, what, state)
    directory = Path(where)
    gguf = gguf_file(directory)
    if gguf is not None:
        return _open_gguf(where, gguf, state)
    if not directory.is_dir():
        raise UsageError(f"{what} {directory}: no such model folder", hint=hint or "give a folder with config.json "
                         "and its weight files, a GGUF file, or a hub repo as hf://NAMESPACE/NAME")
    snapshot = SNAPSHOT.search(directory.as_posix())
    try:
        return PassModel("", where, None, open_model(ModelRef(where), directory=directory, copies=False))
    except ModelInputError:
        if snapshot is None:
            raise
    # A hub input's cache snapshot without its weights (the merge streamed them): read them by range, and named
    # as the repo at that commit.
    return _open_hub(f"{SCHEME}{snapshot[1]}/{snapshot[2]}@{snapshot[3]}", what, state)


def gguf_file(where: Path) -> Path | None:
    """The GGUF model ``where`` is: the file itself, or the one GGUF model (a file, or a split set's first file)
    of a folder without config.json; None otherwise (a folder of several GGUF models is left to the model
    folder's own refusal)."""
    if where.suffix == ".gguf" and where.is_file():
        return where
    if not where.is_dir() or (where / "config.json").is_file():
        return None
    found = [p for p in sorted(where.glob("*.gguf")) if p.is_file() and not _LATER_PART.search(p.name)]
    return found[0] if len(found) == 1 else None


def _open_gguf(where: str, file: Path, state: StateDir) -> PassModel:
    """A GGUF model: its headers read, its folder of rebuilt files (made under the state dir once) in place of
    the file's own folder, so the forward pass and the prompts read it as any model folder."""
    from resumerge.inputs.gguf.folder import gguf_folder

    opened = open_model(ModelRef(str(file)), copies=False)
    return PassModel("", where, None, replace(opened, directory=gguf_folder(opened, state.gguf_dir)))


def _open_hub(where: str, what: str, state: StateDir) -> PassModel:
    """A hub repo: its config, tokenizer and headers fetched and checked, its weights to be read by range."""
    from resumerge.inputs.catalog import from_metadata
    from resumerge.inputs.hub import resolve_metadata
    from resumerge.inputs.hub.ranges import StreamedFile

    target = parse_hub_target(where)
    ref = ModelRef(f"{target.namespace}/{target.name}", target.branch)
    meta = resolve_metadata(ref, records_dir=state.records_dir)
    opened = from_metadata(ref, meta, what)
    remote = tuple(StreamedFile(ref.key, name, meta.repo_id, meta.commit, meta.headers[name].file_size,
                                meta.settings.endpoint) for name in meta.weight_files)
    return PassModel("", where, None, opened, remote, {name: meta.headers[name] for name in meta.weight_files})


def _open_hub_gguf(where: str, what: str, state: StateDir) -> PassModel:
    """A GGUF file of a hub repo (``hf://org/repo/path/x.gguf[@rev]``): its headers read by range, its folder of
    rebuilt files made under the state dir (from the headers: no tensor byte), its tensors read by range."""
    from resumerge.config.modelref import parse_model_ref
    from resumerge.inputs.gguf.folder import gguf_folder
    from resumerge.inputs.hub.gguf import gguf_input, hub_gguf, resolve_gguf
    from resumerge.inputs.hub.ranges import StreamedFile

    try:
        ref = parse_model_ref(where[len(SCHEME):])
    except ValueError as exc:
        raise UsageError(f"{what} {where}: {exc}") from None
    if hub_gguf(ref) is None:
        raise UsageError(f"{what} {where} is not a GGUF file of a hub repo",
                         hint="write it as hf://NAMESPACE/NAME/PATH/FILE.gguf[@REVISION]")
    meta = resolve_gguf(ref)
    opened = gguf_input(ref, meta)
    remote = tuple(StreamedFile(ref.key, name, meta.repo_id, meta.commit, meta.headers[name].file_size,
                                meta.settings.endpoint) for name in meta.weight_files)
    return PassModel("", where, None, replace(opened, directory=gguf_folder(opened, state.gguf_dir)), remote,
                   {name: meta.headers[name] for name in meta.weight_files})


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor ``name`` belongs to (None: outside the layers)."""
    found = _LAYER.search(name)
    return int(found.group(1)) if found else None


def where_of(ref: ModelRef) -> str:
    """Where a model a merge config names is: its folder or file here, else the hub: ``hf://ID[@REVISION]``, or
    for a GGUF file of a hub repo ``hf://NAMESPACE/NAME/PATH/FILE.gguf[@REVISION]``."""
    path = ref.path
    if Path(path).exists() or path.startswith((".", "/", "~")) or ref.lora is not None:
        return path
    if path.count("/") == 1 or (path.endswith(".gguf") and path.count("/") >= 2):
        return f"{SCHEME}{ref.key}"
    return path

"""Open every model a config references: local directories as they are, hub ids through the normal HF cache.

Hub inputs go in two phases so that a config mistake costs seconds, not a download: :func:`open_inputs` pins
each repo's commit and reads config.json and the safetensors headers (HTTP Range when not cached) — enough to
plan and validate the whole merge — and :func:`fetch_inputs` then downloads and verifies only the shards the
plan needs. A resume passes the recorded snapshot directories, which pin the same commits even if a branch
has moved since.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.config.locations import StateDir
from resumerge.config.merge_config import MergeConfig
from resumerge.config.modelref import ModelRef
from resumerge.errors import ModelInputError, ResumergeError
from resumerge.inputs.adapters import Adapter, check_adapter, open_adapter
from resumerge.inputs.files import InputFile, TensorSource
from resumerge.inputs.model import ModelInput, open_model
from resumerge.inputs.safetensors_format import Header

if TYPE_CHECKING:
    from resumerge.inputs.hub import ProgressCallback, RepoMetadata

# A recorded hub model: its cache folder (a ledger's record) or ``org/name@<sha>`` (a manifest's, published form).
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})$|^[^/@][^@]*@([0-9a-f]{40})$")
# model_dirs / plan.inputs key suffix of a ``model+adapter`` input's adapter folder and files.
ADAPTER_SUFFIX = "#adapter"


@dataclass
class Inputs:
    """The opened models by reference key, and the hub metadata of those that come from the hub."""

    models: dict[str, ModelInput] = field(default_factory=dict)
    hub: dict[str, RepoMetadata] = field(default_factory=dict)


def open_inputs(
    config: MergeConfig,
    *,
    model_dirs: Mapping[str, str] | None = None,
    state: StateDir | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    on_progress: ProgressCallback | None = None,
    given: Mapping[str, ModelInput] | None = None,
) -> Inputs:
    """Open every referenced model for planning (config.json and headers only; no weights are downloaded).

    ``model_dirs`` are the directories recorded by an earlier plan (a resume). ``given`` maps reference keys to
    models that are already open (a recipe: earlier stages' planned outputs, and inputs another stage opened);
    those are used as they are and not opened again. ``state`` keeps the verification records of hub files (None:
    for this call only). Raises ``InputError`` subclasses for missing or hostile
    models, ``HubUnavailableError`` when a hub model cannot be reached or found in cache.
    """
    inputs = Inputs()
    parsed: dict[tuple[bytes, int], Header] = {}  # two fine-tunes of one base share their headers' parse
    for ref in config.referenced_models():
        if given is not None and ref.key in given:
            inputs.models[ref.key] = given[ref.key]
            continue
        where = yaml_path_of(config, ref)
        recorded = model_dirs or {}
        if ref.lora is None:
            inputs.models[ref.key] = _open_one(ref, recorded.get(ref.key), where, inputs, state, cache_dir,
                                               on_progress, parsed)
            continue
        base_ref = ModelRef(ref.path, ref.revision, override_architecture=ref.override_architecture)
        base = _open_one(base_ref, recorded.get(ref.key), where, inputs, state, cache_dir, on_progress, parsed)
        adapter = _open_adapter(ref.lora, recorded.get(adapter_key(ref.key)), where, state, cache_dir,
                                on_progress)
        check_adapter(adapter, {n: (t.entry.dtype, t.entry.shape) for n, t in base.tensors.items()}, yaml_path=where)
        if base_ref.key in inputs.hub:  # fetch_inputs downloads the base's weights under the merged model's key
            inputs.hub[ref.key] = inputs.hub.pop(base_ref.key)
        inputs.models[ref.key] = replace(base, ref=ref, adapter=adapter)
    return inputs


def adapter_key(key: str) -> str:
    """The key under which a plan records the adapter folder and files of the ``model+adapter`` input ``key``."""
    return key + ADAPTER_SUFFIX


def _open_one(
    ref: ModelRef,
    recorded: str | None,
    where: str,
    inputs: Inputs,
    state: StateDir | None,
    cache_dir: str | os.PathLike[str] | None,
    on_progress: ProgressCallback | None,
    parsed: dict[tuple[bytes, int], Header],
) -> ModelInput:
    """Open one model: from its recorded directory (a resume), as a local folder, or from the hub (two phases).
    A local model's safetensors headers are parsed once with the others' (``parsed``)."""
    folder, pinned = _recorded_at(recorded, ref.path)
    if folder is not None:
        return open_model(ref, yaml_path=where, directory=folder, parsed=parsed)
    from resumerge.inputs.hub import is_local

    if pinned is None and is_local(ref):  # the hub's client imported for a hub model only
        return open_model(ref, yaml_path=where, parsed=parsed)
    from resumerge.inputs.hub import resolve_metadata
    from resumerge.inputs.hub.gguf import gguf_input, hub_gguf, resolve_gguf

    try:
        if hub_gguf(ref) is not None:  # a GGUF file of a hub repo: its headers read by range, its tensors later
            meta = resolve_gguf(ref, cache_dir=Path(cache_dir) if cache_dir else None,
                                pinned_commit=pinned, on_progress=on_progress)
            inputs.hub[ref.key] = meta
            return gguf_input(ref, meta)
        meta = resolve_metadata(ref, cache_dir=Path(cache_dir) if cache_dir else None,
                                pinned_commit=pinned,
                                records_dir=_records_dir(state), on_progress=on_progress)
    except ResumergeError as exc:
        exc.yaml_path = exc.yaml_path or where  # the hub layer knows the repo, the config knows where
        raise
    inputs.hub[ref.key] = meta
    return from_metadata(ref, meta, where)


def _open_adapter(
    ref: ModelRef,
    recorded: str | None,
    where: str,
    state: StateDir | None,
    cache_dir: str | os.PathLike[str] | None,
    on_progress: ProgressCallback | None,
) -> Adapter:
    """Open the LoRA adapter ``ref``: a local folder, or a hub repo fetched whole (it is small) and verified."""
    folder, pinned = _recorded_at(recorded, ref.path)
    if folder is not None:
        return open_adapter(folder, yaml_path=where)
    from resumerge.inputs.hub import is_local

    if pinned is None and is_local(ref):
        return open_adapter(Path(ref.path), yaml_path=where)
    from resumerge.inputs.hub.adapters import open_hub_adapter

    return open_hub_adapter(ref, yaml_path=where, cache_dir=Path(cache_dir) if cache_dir else None,
                            pinned_commit=pinned, records_dir=_records_dir(state),
                            on_progress=on_progress)


def _recorded_at(recorded: str | None, named: str) -> tuple[Path | None, str | None]:
    """Where a resume finds a model by its ``recorded`` entry: this machine's folder (the ledger's record of a
    local model), or the hub commit it pins (a cache folder, or a manifest's ``org/name@<sha>``); neither: a
    manifest's local model, recorded as the config ``named`` it (relative as typed, or a GGUF input's file where
    the ledger records its folder), is opened by the config's reference."""
    pinned = _SNAPSHOT.search(recorded or "")
    if pinned is not None:
        return None, pinned[1] or pinned[2]
    if recorded is not None and recorded != named and Path(recorded).is_absolute():
        return Path(recorded), None
    return None, None


def fetch_inputs(inputs: Inputs, *, state: StateDir, on_progress: ProgressCallback | None = None) -> None:
    """Download (resuming partial files) and verify the weights of every hub input; local inputs need nothing."""
    if not inputs.hub:  # nothing to fetch: the hub's client is not imported
        return
    from resumerge.inputs.hub import fetch_weights

    for meta in inputs.hub.values():
        fetch_weights(meta, records_dir=state.records_dir, on_progress=on_progress)


def _records_dir(state: StateDir | None) -> Path | None:
    """Where hub files' verification is recorded: the state dir's records (None: in memory, for one call)."""
    return state.records_dir if state is not None else None


def from_metadata(ref: ModelRef, meta: RepoMetadata, where: str) -> ModelInput:
    """The hub model ``ref`` opened from what :func:`~resumerge.inputs.hub.resolve_metadata` learned (its config
    and headers; its directory the cache snapshot); ``where`` names it in errors (a YAML path)."""
    if meta.config_path is None:
        raise ModelInputError(f"hub model {ref.key} has no config.json", yaml_path=where)
    config = json.loads(meta.config_path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ModelInputError(f"config.json of {ref.key} is not a JSON object", yaml_path=where)
    tensors: dict[str, TensorSource] = {}
    files = []
    for name in meta.weight_files:
        header = meta.headers[name]
        if not isinstance(header, Header):
            raise ValueError(f"{ref.key} is a GGUF: open it with resumerge.inputs.hub.gguf.gguf_input")
        for tname, entry in header.tensors.items():
            tensors[tname] = TensorSource(name, entry)
        remote = meta.files[name]
        # The hub's own checksum is the content identity: stronger than sampling, and known before download.
        files.append(InputFile(name, header.file_size, remote.sha256 or remote.blob_id or ""))
    return ModelInput(ref, meta.snapshot_dir, config, tensors, tuple(files))


def yaml_path_of(config: MergeConfig, ref: ModelRef) -> str:
    """Where ``ref`` first appears in the YAML (for error messages)."""
    if config.base_model is not None and config.base_model.key == ref.key:
        return "base_model"
    for src in config.all_models():
        if src.model.key == ref.key:
            return f"{src.yaml_path}.model"
    for sl in config.all_slices():
        for src in sl.sources:
            if src.model.key == ref.key:
                return f"{src.yaml_path}.model"
    return ""

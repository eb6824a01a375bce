"""The models a check compares: MODEL, and its base and parents, given or read from its record.

A resumerge output's manifest holds the merge config and where each of its models was: the config's
``base_model`` is the base and its ``models`` the parents (their ``weight`` parameters, where plain numbers, are
the merge's own weights); a transplant's (``resumerge tokensurgeon``) MODEL is its base, and it has no parent.
``--base``/``--parent`` given win over the record.

Any of them may be a hub repo, ``hf://NAMESPACE/NAME[@REVISION]``: its config, tokenizer and safetensors headers
are fetched into the Hugging Face cache (as a merge's hub inputs are) and its weights read by HTTP Range at the
commit pinned then, never downloaded whole, and held to the hub's checksums as a merge's streamed inputs are
(:mod:`resumerge.forward.opening.hubreads`). A recorded model that was a hub input is read the same way where its
cache snapshot lacks its weights (a merge that streamed it).

Any of them may be a GGUF file (or the first file of a split set; one in a hub repo written
``hf://NAMESPACE/NAME/PATH/FILE.gguf[@REVISION]``, its headers and tensors read by range), or a folder holding one
GGUF model and no config.json (a resumerge output written with ``--out-type gguf``): its tensors are decoded by the
GGUF codec, and its config.json and tokenizer are rebuilt from its metadata into a folder of its own under the
state dir (:func:`~resumerge.inputs.gguf.folder.gguf_folder`), which is the model's folder for the forward pass and
the prompts. The report names the path given.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from resumerge.config.hubtarget import SCHEME, is_hub_target
from resumerge.config.locations import StateDir
from resumerge.config.merge_config import MergeConfig, SourceConfig, load_config_text
from resumerge.config.modelref import ModelRef, parse_model_ref
from resumerge.config.transplantmark import transplanted_model
from resumerge.errors import ResumergeError, UsageError
from resumerge.forward.opening.opened import SNAPSHOT, PassModel, gguf_file, open_for_pass
from resumerge.merge.store.manifest import PUBLISHED_HUB, read_manifest

# A model of the check, opened for its pass (the forward engine's one opener: :mod:`resumerge.forward.opening.opened`).
Checked = PassModel
open_checked = open_for_pass

MERGEKIT_CONFIG = "mergekit_config.yml"  # what mergekit writes into its output: the config it merged


def find_models(model: str | os.PathLike[str], base: str | os.PathLike[str] | None,
                parents: tuple[str | os.PathLike[str], ...], state: StateDir
                ) -> list[Checked]:
    """The merge first, then the base (if any), then each parent; raises :class:`UsageError` for a folder that
    is not a model (exit 2, before anything is read). A hub model's small files are fetched (verification
    records under ``state``)."""
    if not os.fspath(model).strip():
        raise UsageError("MODEL is empty", hint="name the merged model's folder")
    _finished(os.fspath(model), state)
    merge = open_checked(os.fspath(model), "MODEL", state)
    record = merge.opened.directory if merge.opened.gguf is None else Path(merge.path)
    try:
        recorded_base, recorded, source = _recorded(record, state)
    except ResumergeError:  # a record that cannot be read: where the models are given, they are all it needs
        if base is None and not parents:
            raise
        recorded_base, recorded, source = None, [], ""
    chosen_base = os.fspath(base) if base is not None else recorded_base if not parents else None
    chosen = [(os.fspath(p), None) for p in parents] if parents else recorded if base is None else []
    found = [replace(merge, role="merge")]
    # A recorded model is named as recorded (no --base or --parent was typed), with what to do where it is gone.
    hint = f"give the models with --base and --parent (they win over {source})" if source else None
    if chosen_base is not None:
        what = "--base" if base is not None else f"{source} names the base"
        found.append(replace(open_checked(chosen_base, what, state, hint if base is None else None), role="base"))
    found.extend(replace(open_checked(p, "--parent" if parents else f"{source} names the parent", state,
                                      None if parents else hint), role="parent", weight=w) for p, w in chosen)
    if source:  # the merge's own base and parents are those its record names; any other was only compared with
        own = {same_model(recorded_base)} if recorded_base is not None else set()
        own.update(same_model(p) for p, _ in recorded)
        found = [found[0]] + [replace(m, own=same_model(m.path) in own) for m in found[1:]]
    return found


def same_model(path: str) -> str:
    """``path`` as compared with a record's (a local folder by its absolute path)."""
    return path if is_hub_target(path) else os.path.abspath(path)


def recorded_models(out: Path) -> tuple[str | None, list[str]]:
    """The base and the parents ``out``'s record names (its manifest, or mergekit's config; none: neither)."""
    base, parents, _ = _recorded(out)
    return base, [p for p, _ in parents]


def _finished(model: str, state: StateDir) -> None:
    """Refuse (exit 2) a resumerge output whose merge is not finished (its ledger here, no config.json yet): a
    merge still running, or one interrupted, is checked once it is done, and said so rather than "no config.json"."""
    from resumerge.machine.runlock import is_locked

    if is_hub_target(model) or (Path(model) / "config.json").is_file() or gguf_file(Path(model)) is not None:
        return
    run = state.run(model)
    if not run.ledger.is_file():
        return
    if is_locked(run.run_dir):
        raise UsageError(f"{model} is still being written: a merge into it is running",
                         hint="check it once the merge is done (resumerge status shows where it is)")
    raise UsageError(f"the merge into {model} is not finished", hint=f"finish it with {run.resume_command}, "
                     "then check it")


def _recorded(out: Path, state: StateDir | None = None) -> tuple[str | None, list[tuple[str, float | None]], str]:
    """The base and the parents (with their weights) a resumerge output's manifest records, or a mergekit
    output's ``mergekit_config.yml`` names (none: neither), and which record it was (its words, for messages); a
    hub OUT's manifest is in its cache snapshot. A model recorded at a folder this machine lacks (a hub input's
    snapshot on the machine that merged) is named as ``hf://`` at the commit that was merged."""
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is None:
        return _mergekit_recorded(out)
    dirs = {key: _here(directory) for key, directory in manifest.model_dirs.items()} | _ledger_dirs(out, state)
    transplanted = transplanted_model(manifest.config_text)
    if transplanted is not None:  # a transplant's MODEL is its base; DONOR lent only its tokenizer
        return _located(parse_model_ref(transplanted), dirs), [], f"{out}'s record"
    config = load_config_text(manifest.config_text, source=str(out))
    return *_named(config, dirs), f"{out}'s record"


def _mergekit_recorded(out: Path) -> tuple[str | None, list[tuple[str, float | None]], str]:
    """The base and parents the ``mergekit_config.yml`` mergekit writes into its output names: a local folder
    where it is one here, else a hub id read from the hub (``hf://``, at the revision named)."""
    from resumerge.errors import ConfigError

    path = out / MERGEKIT_CONFIG
    if not path.is_file():
        return None, [], ""
    try:
        config = load_config_text(path.read_text(encoding="utf-8"), source=str(path))
    except (ConfigError, OSError, UnicodeDecodeError):  # a config resumerge cannot read: compared with nothing
        return None, [], ""
    refs = ([config.base_model] if config.base_model is not None else []) + [s.model for s in _sources(config)]
    dirs = {ref.key: _where(ref) for ref in refs if Path(ref.path).suffix != ".gguf"}
    return *_named(config, dirs), str(path)


def _where(ref: ModelRef) -> str:
    """Where a model a mergekit config names is: its folder here, else the hub repo (``hf://ID[@REVISION]``)."""
    if Path(ref.path).exists() or ref.path.startswith((".", "/", "~")) or ref.path.count("/") != 1:
        return ref.path
    return f"{SCHEME}{ref.key}" if ref.lora is None else ref.path


def _named(config: MergeConfig, dirs: dict[str, str]) -> tuple[str | None, list[tuple[str, float | None]]]:
    """The base and the parents (with their weights) of ``config``, each where ``dirs`` places it."""
    base = None if config.base_model is None else _located(config.base_model, dirs)
    parents: list[tuple[str, float | None]] = []
    for source in _sources(config):
        if config.base_model is not None and source.model.key == config.base_model.key:
            continue
        path = _located(source.model, dirs)
        if path not in (p for p, _ in parents):
            weight = source.parameters.get("weight")
            parents.append((path, float(weight) if isinstance(weight, (int, float)) else None))
    return base, parents


def _located(model: ModelRef, dirs: dict[str, str]) -> str:
    """Where recorded ``model`` is: its recorded folder, or the GGUF file in it (a GGUF input's ledger names the
    file's folder), else its path in the config (so a manifest that records it as the config names it)."""
    if model.key not in dirs or dirs[model.key] == model.path:
        return model.path
    if Path(model.path).suffix == ".gguf":
        return str(Path(dirs[model.key]) / Path(model.path).name)
    return dirs[model.key]


def _ledger_dirs(out: Path, state: StateDir | None) -> dict[str, str]:
    """The local folders this machine's ledger of the merge into ``out`` read its models from (the manifest names
    them as the config does, relative to where the merge ran): none without a readable ledger."""
    from resumerge.errors import LedgerError
    from resumerge.merge.store.ledger_read import read_merge_record

    ledger = state.run(str(out)).ledger if state is not None else None
    try:
        record = read_merge_record(ledger) if ledger is not None and ledger.is_file() else None
    except LedgerError:
        return {}
    dirs = record.run.model_dirs if record is not None else {}
    return {key: folder for key, folder in dirs.items() if Path(folder).is_dir() and Path(folder).is_absolute()}


def _here(directory: str) -> str:
    if PUBLISHED_HUB.fullmatch(directory):  # a hub model as a manifest records it: org/name@<sha>
        return f"{SCHEME}{directory}"
    snapshot = SNAPSHOT.search(directory)  # a manifest written before the published form: the cache snapshot
    if snapshot is None or Path(directory).is_dir():
        return directory
    return f"{SCHEME}{snapshot[1]}/{snapshot[2]}@{snapshot[3]}"


def _sources(config: MergeConfig) -> list[SourceConfig]:
    found: list[SourceConfig] = []
    if config.models:
        found.extend(config.models)
    for piece in config.slices or ():
        found.extend(piece.sources)
    return found

"""The models a check compares: MODEL, and its base and parents, given or read from its record.

A resumerge output's manifest holds the merge config and where each of its models was: the config's
``base_model`` is the base and its ``models`` the parents (their ``weight`` parameters, where plain numbers, are
the merge's own weights). ``--base``/``--parent`` given win over the record.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from resumerge.config.merge_config import MergeConfig, SourceConfig, load_config_text
from resumerge.config.modelref import ModelRef
from resumerge.errors import UsageError
from resumerge.inputs.model import ModelInput, open_model
from resumerge.store.manifest import read_manifest


@dataclass(frozen=True)
class Checked:
    """One model of the check: its ``role`` (merge, base, parent), where it is, its weight in the merge (None:
    not known) and the model opened (headers only)."""

    role: str
    path: str
    weight: float | None
    opened: ModelInput


def find_models(model: str | os.PathLike[str], base: str | os.PathLike[str] | None,
                parents: tuple[str | os.PathLike[str], ...]) -> list[Checked]:
    """The merge first, then the base (if any), then each parent; raises :class:`UsageError` for a folder that
    is not a model (exit 2, before anything is read)."""
    if not os.fspath(model).strip():
        raise UsageError("MODEL is empty", hint="name the merged model's folder")
    merge_dir = Path(model)
    recorded_base, recorded = _recorded(merge_dir) if base is None and not parents else (None, [])
    chosen_base = str(base) if base is not None else recorded_base
    chosen = [(str(p), None) for p in parents] if parents else recorded
    found = [Checked("merge", str(merge_dir), None, _open(merge_dir, "MODEL"))]
    if chosen_base is not None:
        found.append(Checked("base", chosen_base, None, _open(Path(chosen_base), "--base")))
    found.extend(Checked("parent", p, w, _open(Path(p), "--parent")) for p, w in chosen)
    return found


def _open(directory: Path, what: str) -> ModelInput:
    if not directory.is_dir():
        raise UsageError(f"{what} {directory}: no such model folder", hint="give a folder with config.json and "
                         "its weight files")
    return open_model(ModelRef(str(directory)), directory=directory)


def _recorded(out: Path) -> tuple[str | None, list[tuple[str, float | None]]]:
    """The base and the parents (with their weights) a resumerge output's manifest records (none: not one)."""
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is None:
        return None, []
    config = load_config_text(manifest.config_text, source=str(out))
    dirs = dict(manifest.model_dirs)
    base = None if config.base_model is None else dirs.get(config.base_model.key, config.base_model.path)
    parents: list[tuple[str, float | None]] = []
    for source in _sources(config):
        if config.base_model is not None and source.model.key == config.base_model.key:
            continue
        path = dirs.get(source.model.key, source.model.path)
        if path not in (p for p, _ in parents):
            weight = source.parameters.get("weight")
            parents.append((path, float(weight) if isinstance(weight, (int, float)) else None))
    return base, parents


def _sources(config: MergeConfig) -> list[SourceConfig]:
    found: list[SourceConfig] = []
    if config.models:
        found.extend(config.models)
    for piece in config.slices or ():
        found.extend(piece.sources)
    return found

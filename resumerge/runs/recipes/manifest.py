"""The record of a recipe: ``resumerge-recipe.json`` in OUT, and the same document in the recipe ledger.

Written atomically into OUT before the first stage runs, it holds the recipe text, the options, the intermediate
dir, the input directories (hub commits pinned) and every stage's name, output dir, fingerprint and fingerprint
parts — so ``resumerge resume OUT`` finds the whole recipe from OUT alone, even when the recipe died in its first
stage and the state dir was lost. The ledger keeps this machine's folders; OUT's copy names none
(:func:`published_record`: the models as the config names them or pinned on the hub, the places relative to OUT),
and is read back at this machine's places (:func:`located_record`). No timestamps: the same recipe and options, of
the same models from any folder, give the same bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import RunLocations, StateDir
from resumerge.errors import LedgerError
from resumerge.machine.durable import write_file_atomic
from resumerge.runs.recipes.ledger_read import RECIPE_LEDGER_NAME, RecipeRow, read_recipe_row

RECIPE_MANIFEST_NAME = "resumerge-recipe.json"
FORMAT = 1
# What happened to the named stages' outputs after the final merge was verified (--cleanup-intermediates).
KEPT, DELETING, DELETED = "kept", "deleting", "deleted"


def stage_label(name: str | None, document: int) -> str:
    """How a person names a stage: ``stage NAME``, or ``document N`` for an unnamed one."""
    return f"stage {name}" if name is not None else f"document {document}"


class Labelled:
    """A stage as its records name it (its ``name``, None for an unnamed one, and its ``document``), with the
    :attr:`label` a person knows it by."""

    name: str | None
    document: int

    @property
    def label(self) -> str:
        return stage_label(self.name, self.document)


@dataclass(frozen=True)
class StageEntry(Labelled):
    """One stage as planned: key (name, or ``#N`` for the unnamed document), output dir, fingerprint."""

    key: str
    name: str | None
    document: int
    out_dir: str
    fingerprint: str
    final: bool
    parts: Mapping[str, str] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RecipeRecord:
    """The recorded recipe; ``state`` is running|done, ``intermediates`` kept|deleting|deleted."""

    version: str
    fingerprint: str
    recipe_text: str
    intermediate_dir: str
    options: Mapping[str, Any]
    model_dirs: Mapping[str, str]
    cleanup: bool
    stages: tuple[StageEntry, ...]
    state: str = "running"
    intermediates: str = KEPT

    @property
    def final(self) -> StageEntry:
        """The stage written to OUT."""
        return next(s for s in self.stages if s.final)

    def to_doc(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "format": FORMAT,
            "resumerge_version": self.version,
            "fingerprint": self.fingerprint,
            "recipe_text": self.recipe_text,
            "intermediate_dir": self.intermediate_dir,
            "options": dict(self.options),
            "model_dirs": dict(self.model_dirs),
            "cleanup_intermediates": self.cleanup,
            "stages": [
                {"key": s.key, "name": s.name, "document": s.document, "out_dir": s.out_dir,
                 "fingerprint": s.fingerprint, "final": s.final, "parts": dict(s.parts), "inputs": dict(s.inputs)}
                for s in self.stages
            ],
            "state": self.state,
            "intermediates": self.intermediates,
        }

    def to_bytes(self) -> bytes:
        """Deterministic JSON (sorted keys, 2-space indent, trailing newline)."""
        return (json.dumps(self.to_doc(), indent=2, sort_keys=True) + "\n").encode("utf-8")


def record_from_doc(doc: Any, where: str) -> RecipeRecord:
    """Parse a recipe record document; raises :class:`LedgerError` naming ``where`` when it is malformed."""
    try:
        if doc.get("format") != FORMAT:
            raise ValueError(f"unknown recipe record format {doc.get('format')!r}")
        stages = tuple(
            StageEntry(str(s["key"]), None if s["name"] is None else str(s["name"]), int(s["document"]),
                       str(s["out_dir"]), str(s["fingerprint"]), bool(s["final"]), dict(s["parts"]),
                       dict(s["inputs"]))
            for s in doc["stages"]
        )
        if sum(1 for s in stages if s.final) != 1:
            raise ValueError("exactly one stage must be final")
        return RecipeRecord(
            version=str(doc["resumerge_version"]),
            fingerprint=str(doc["fingerprint"]),
            recipe_text=str(doc["recipe_text"]),
            intermediate_dir=str(doc["intermediate_dir"]),
            options=dict(doc["options"]),
            model_dirs={str(k): str(v) for k, v in doc["model_dirs"].items()},
            cleanup=bool(doc["cleanup_intermediates"]),
            stages=stages,
            state=str(doc["state"]),
            intermediates=str(doc["intermediates"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LedgerError(
            f"the recipe record {where} is unreadable ({exc})",
            path=where,
            hint="it was not written by this resumerge; use a new output directory",
        ) from None


def recipe_dir(where: RunLocations) -> Path:
    """The state folder of the recipe writing to the OUT of ``where`` (its ledger and lock):
    ``recipe-<name>-<hash>``, beside the run folder of a single merge into it."""
    return where.root / f"recipe-{where.run_dir.name}"


def published_record(record: RecipeRecord, out: str | os.PathLike[str]) -> RecipeRecord:
    """``record`` (this machine's, as the recipe ledger keeps it) as OUT ``out`` holds it: no machine path, so the
    same recipe of the same models from other folders or state dirs writes the same bytes and an ``hf://`` OUT
    publishes no home folder. Its models as a merge's manifest records them (:func:`published_dirs`: a hub model
    as ``org/name@<sha>``, a local one as the config names it), a file option by its base name (the digest beside
    it: :func:`~resumerge.merge.plan.changes.recorded_options`), and the places of the stages' outputs relative to
    OUT (``../OUT.intermediates/NAME``; the final stage ``.``), or for a repo OUT, which has no "beside",
    relative to the intermediate dir's parent (``NAME.intermediates/STAGE``: where a resume finds them is this
    machine's, :func:`located_record`). A record read back from OUT is published unchanged."""
    from resumerge.merge.plan.changes import recorded_options
    from resumerge.merge.plan.merge_plan import PlanOptions
    from resumerge.merge.store.manifest import published_dirs

    hub = is_hub_target(os.fspath(out))
    base = Path(record.intermediate_dir).parent if hub else Path(os.fspath(out)).absolute()

    def place(path: str) -> str:
        return os.path.relpath(path, base) if Path(path).is_absolute() else path

    stages = tuple(s if hub and s.final else replace(s, out_dir=place(s.out_dir)) for s in record.stages)
    return replace(record, intermediate_dir=place(record.intermediate_dir),
                   model_dirs=published_dirs(record.model_dirs),
                   options=recorded_options(PlanOptions(**record.options)), stages=stages)


def located_record(record: RecipeRecord, out: str | os.PathLike[str], intermediates: Path | None = None
                   ) -> RecipeRecord:
    """``record`` as OUT ``out`` holds it (:func:`published_record`) with its places on this machine: a folder
    OUT's relative to OUT (wherever OUT is now); a repo OUT's in ``intermediates`` (this state dir's default:
    nothing of the machine that recorded it is here), or left as read without one. An older record's absolute
    places are kept."""
    if is_hub_target(os.fspath(out)):
        if intermediates is None or Path(record.intermediate_dir).is_absolute():
            return record
        stages = tuple(s if s.final or Path(s.out_dir).is_absolute() else
                       replace(s, out_dir=str(intermediates / Path(s.out_dir).name)) for s in record.stages)
        return replace(record, intermediate_dir=str(intermediates), stages=stages)
    base = Path(os.fspath(out)).absolute()

    def here(path: str) -> str:
        return path if Path(path).is_absolute() else os.path.normpath(base / path)

    return replace(record, intermediate_dir=here(record.intermediate_dir),
                   stages=tuple(replace(s, out_dir=here(s.out_dir)) for s in record.stages))


def write_recipe_manifest(out_dir: Path, record: RecipeRecord) -> None:
    """Atomically replace ``OUT/resumerge-recipe.json`` with ``record`` as OUT holds it (:func:`published_record`)."""
    write_file_atomic(out_dir / RECIPE_MANIFEST_NAME, published_record(record, out_dir).to_bytes())


def read_recipe_manifest(out_dir: Path) -> RecipeRecord | None:
    """The record in ``OUT/resumerge-recipe.json``; None when absent. Raises :class:`LedgerError` if unreadable."""
    path = out_dir / RECIPE_MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LedgerError(f"the recipe record {path} is unreadable ({exc})", path=str(path)) from None
    return located_record(record_from_doc(doc, str(path)), out_dir)


def recipe_ledger_record(path: Path) -> tuple[RecipeRecord, RecipeRow] | None:
    """The record and the ``recipe`` row of the recipe ledger at ``path`` (read-only); None without a file or a
    row. Raises :class:`LedgerError` when the ledger cannot be read."""
    if not path.exists():
        return None
    row = read_recipe_row(path)
    return (record_from_doc(row.record, str(path)), row) if row is not None else None


def read_recipe_ledger(path: Path) -> tuple[RecipeRecord, RecipeRow] | None:
    """:func:`recipe_ledger_record`, but None when the ledger cannot be read: a damaged recipe ledger is never
    trusted (OUT's record stands in, and the next run or resume sets the file aside)."""
    try:
        return recipe_ledger_record(path)
    except LedgerError:
        return None


def read_recipe_record(out_dir: str | os.PathLike[str], state: StateDir) -> tuple[RecipeRecord, str] | None:
    """The recorded recipe of ``out_dir`` and where it came from (``ledger`` or ``manifest``); None if none."""
    found = read_recipe_ledger(recipe_dir(state.run(out_dir)) / RECIPE_LEDGER_NAME)
    if found is not None:
        return found[0], "ledger"
    record = read_recipe_manifest(Path(out_dir))
    return (record, "manifest") if record is not None else None

"""Where a recipe stands, read without torch or sqlite-utils (like :mod:`resumerge.merge.store.statusview`).

The stage list comes from the recipe record (the recipe ledger, else ``OUT/resumerge-recipe.json``); each
stage's state and progress from that stage's own ledger or manifest, through :func:`read_status`. A recipe
recorded as running whose lock no process holds is reported as interrupted. For an ``hf://`` OUT without a
recipe ledger here, the record and the final stage's manifest are read from the repo (a few small requests).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import RunLocations, StateDir
from resumerge.errors import LedgerError, NothingRecordedError
from resumerge.merge.store.ledger_read import read_merge_record
from resumerge.merge.store.manifest import Manifest, read_manifest
from resumerge.merge.store.statusview import StatusReport, read_status
from resumerge.runs.recipes.held import out_record
from resumerge.runs.recipes.ledger_read import RECIPE_LEDGER_NAME, StageRow, read_recipe_stages
from resumerge.runs.recipes.manifest import (
    DELETED,
    DELETING,
    Labelled,
    RecipeRecord,
    recipe_dir,
    recipe_ledger_record,
)


@dataclass(frozen=True)
class StageRecord:
    """What a stage's own ledger (else manifest) says: its plan's fingerprint (and parts, input identities),
    its state, and how many planned files are committed."""

    fingerprint: str
    parts: dict[str, str]
    inputs: dict[str, Any]
    state: str
    files_total: int
    files_done: int
    source: str

    @property
    def complete(self) -> bool:
        """True when the stage says it finished and every planned file is committed."""
        return self.state == "done" and self.files_done == self.files_total


@dataclass(frozen=True)
class StageStatus(Labelled):
    """One stage: where it writes, its state (pending|running|interrupted|failed|done|deleted) and progress."""

    key: str
    name: str | None
    document: int
    final: bool
    out_dir: str
    state: str
    shards_done: int = 0
    shards_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    started_at: float | None = None
    finished_at: float | None = None


@dataclass(frozen=True)
class RecipeStatus:
    """The state of a recipe writing to ``out_dir``; ``current`` details the first stage not yet done."""

    out_dir: str
    state: str
    source: str
    intermediate_dir: str
    intermediates: str
    stages: tuple[StageStatus, ...]
    current: StatusReport | None = None
    last_error: str | None = None
    events: tuple[str, ...] = field(default=())
    resume_command: str | None = None

    @property
    def stages_done(self) -> int:
        """Stages whose output is complete (or was complete and deleted after the final merge)."""
        return sum(1 for s in self.stages if s.state in ("done", "deleted"))

    def to_json(self) -> dict[str, Any]:
        """The JSON form printed by ``status --json``."""
        doc = asdict(self)
        doc["kind"] = "recipe"
        doc["stages"] = [asdict(s) | {"label": s.label} for s in self.stages]
        doc["stages_done"] = self.stages_done
        doc["current"] = self.current.to_json() if self.current is not None else None
        doc["events"] = list(self.events)
        return doc


def stage_record(out_dir: str | os.PathLike[str], state: StateDir, *,
                 repo_manifest: Manifest | None = None) -> StageRecord | None:
    """The record of the merge into ``out_dir`` (its ledger, else its manifest), or None when there is none.

    For an ``hf://`` OUT the manifest is the repo's: ``repo_manifest`` when the caller read it already, else read
    (one small request). A ledger that cannot be read (killed while being created, damaged) is passed over for the
    manifest. Raises :class:`LedgerError` when the manifest is unreadable.
    """
    where = state.run(out_dir)
    ledger = where.ledger
    if ledger.exists():
        try:
            found = read_merge_record(ledger)
        except LedgerError:
            # A stage killed while creating its ledger (no tables yet), or a WAL a read-only reader cannot recover,
            # or a damaged file: never trusted. The stage's manifest tells what is committed (without one,
            # nothing is), and its resume sets such a ledger aside.
            found = None
        if found is not None:
            run = found.run
            return StageRecord(run.fingerprint, dict(run.parts), dict(run.inputs), run.state, len(found.files),
                               found.files_done, "ledger")
    if is_hub_target(out_dir):
        manifest = repo_manifest if repo_manifest is not None else _repo_manifest(where)
    else:
        manifest = read_manifest(Path(out_dir)) if Path(out_dir).is_dir() else None
    if manifest is None:
        return None
    committed = sum(1 for n in manifest.planned if n in manifest.committed)
    return StageRecord(manifest.fingerprint, dict(manifest.parts), dict(manifest.inputs), manifest.state,
                       len(manifest.planned), committed, "manifest")


def read_recipe_status(out_dir: str | os.PathLike[str], at: StateDir) -> RecipeStatus:
    """Status of the recipe writing to ``out_dir`` (its records under the state dir ``at``); raises
    :class:`~resumerge.errors.NothingRecordedError` when no recipe is recorded (a :class:`LedgerError` too)."""
    from resumerge.machine.runlock import is_locked

    where = at.run(out_dir)
    rdir = recipe_dir(where)
    rows: dict[str, StageRow] = {}
    events: tuple[str, ...] = ()
    last_error = None
    damage: LedgerError | None = None
    try:
        found = recipe_ledger_record(rdir / RECIPE_LEDGER_NAME)
    except LedgerError as exc:  # a damaged recipe ledger is never trusted: OUT's record stands in for it
        found, damage = None, exc
    if found is not None:
        record, source, state, last_error = found[0], "ledger", found[1].state, found[1].last_error
        if state == "running" and not is_locked(rdir):
            state = "interrupted"
        rows, event_rows = read_recipe_stages(rdir / RECIPE_LEDGER_NAME)
        events = tuple(f"{e.kind}: {e.message}" for e in event_rows)
    else:
        manifest = out_record(where)
        if manifest is None:
            if damage is not None:
                raise damage
            raise NothingRecordedError.of(out_dir, "recipe")
        record, source = manifest, "manifest"
        state = "done" if record.state == "done" else "interrupted"
        whose = "the repo's" if is_hub_target(out_dir) else "OUT's"
        why = "recipe ledger not found" if damage is None else damage.message
        events = (f"{why}: figures from {whose} resumerge-recipe.json and the stages' records",)
    stages = tuple(_stage_status(record, s.key, rows.get(s.key), where.state, out_dir) for s in record.stages)
    command = None if state in ("done", "running") else where.resume_command
    current = None
    pending = next((s for s in stages if s.state not in ("done", "deleted")), None)
    if pending is not None and pending.state != "pending":
        # A stage of a recipe is finished through the recipe's OUT, never on its own.
        current = replace(read_status(pending.out_dir, where.state), resume_command=command)
    return RecipeStatus(str(out_dir), state, source, record.intermediate_dir, record.intermediates, stages, current,
                        last_error, events, command)


def _repo_manifest(where: RunLocations) -> Manifest | None:
    from resumerge.merge.store.hubstatus import remote_manifest_bytes
    from resumerge.merge.store.manifest import parse_manifest

    try:
        data, found = remote_manifest_bytes(where.out, where.resume_command)
    except LedgerError:  # the repo holds no manifest: nothing of this stage is committed
        return None
    return parse_manifest(data, found)


def _stage_status(record: RecipeRecord, key: str, row: StageRow | None,
                  state: StateDir, out_dir: str | os.PathLike[str]) -> StageStatus:
    entry = next(s for s in record.stages if s.key == key)
    if entry.final and not is_hub_target(out_dir):
        # The final stage writes to OUT, wherever OUT is now: a moved OUT's record still names the old path.
        entry = replace(entry, out_dir=os.path.abspath(out_dir))
    base = StageStatus(entry.key, entry.name, entry.document, entry.final, entry.out_dir, "pending",
                       started_at=row.started_at if row else None, finished_at=row.finished_at if row else None)
    if not entry.final and record.intermediates in (DELETING, DELETED):
        return replace(base, state="deleted")
    own = stage_record(entry.out_dir, state)
    if own is None or own.fingerprint != entry.fingerprint:
        return base
    report = read_status(entry.out_dir, state)
    return replace(base, state="done" if own.complete else report.state, shards_done=report.shards_done,
                   shards_total=report.shards_total, bytes_done=report.bytes_done, bytes_total=report.bytes_total)

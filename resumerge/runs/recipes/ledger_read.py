"""The recipe ledger read-only: its file name, row types and the queries recipe ``status`` and a resume need.

Beside the schema and the writer (:mod:`.ledger`), so one package knows the recipe ledger's tables and columns.
Standard library only (through :func:`resumerge.merge.store.ledger_read.reading`): ``resumerge status`` must not pay
for sqlite-utils. Every reader opens the file read-only and raises :class:`~resumerge.errors.LedgerError` when
SQLite cannot read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.merge.store.ledger_read import EventRow, reading

RECIPE_LEDGER_NAME = "recipe.db"  # a recipe's ledger, in its recipe dir


@dataclass(frozen=True)
class RecipeRow:
    """The ``recipe`` row of a recipe ledger; ``record`` is the recipe record document (decoded JSON)."""

    record: dict[str, Any]
    state: str
    last_error: str | None


@dataclass(frozen=True)
class StageRow:
    """One stage row of a recipe ledger (what ``status`` takes from it: its times; the rest comes from the
    stage's own ledger)."""

    key: str
    state: str
    started_at: float | None
    finished_at: float | None


def read_recipe_row(path: Path) -> RecipeRow | None:
    """The ``recipe`` row of the recipe ledger at ``path``; None when it holds none."""
    with reading(path, "recipe ledger") as conn:
        row = conn.execute("SELECT record, state, last_error FROM recipe WHERE id = 1").fetchone()
        return RecipeRow(json.loads(row["record"]), str(row["state"]), row["last_error"]) if row else None


def read_recipe_stages(path: Path) -> tuple[dict[str, StageRow], tuple[EventRow, ...]]:
    """The stage rows (by key) of the recipe ledger at ``path`` and its latest 8 events, oldest first."""
    with reading(path, "recipe ledger") as conn:
        stages = {r["key"]: StageRow(r["key"], r["state"], r["started_at"], r["finished_at"])
                  for r in conn.execute("SELECT key, state, started_at, finished_at FROM stages")}
        events = conn.execute("SELECT kind, message FROM events ORDER BY id DESC LIMIT 8").fetchall()
        return stages, tuple(EventRow(e["kind"], e["message"]) for e in reversed(events))

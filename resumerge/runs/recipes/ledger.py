"""The recipe ledger: one SQLite file per recipe OUT in the state dir, beside (never inside) the stage ledgers.

Tables: ``recipe`` (one row: the record document of :mod:`resumerge.runs.recipes.manifest`, state, times, last error),
``stages`` (one row per stage: position, output dir, fingerprint, state pending|running|done|interrupted|failed,
started and finished times) and ``events``. It is a journal for ``status``: whether a stage is complete is
decided by that stage's own ledger and checksums, never by this table. Its file name and the read-only queries
``status`` uses are in :mod:`.ledger_read` (standard library only), beside this schema.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from resumerge.merge.store.journal import Journal
from resumerge.merge.store.sqlitedb import Database, Migrations
from resumerge.runs.recipes.manifest import RECIPE_MANIFEST_NAME, RecipeRecord

migrations = Migrations("resumerge-recipe")


@migrations()
def m001_initial(db: Database) -> None:
    """The first schema."""
    db.table("recipe").create(
        {"id": int, "out_dir": str, "fingerprint": str, "record": str, "state": str, "created_at": float,
         "updated_at": float, "last_error": str},
        pk="id",
    )
    db.table("stages").create(
        {"key": str, "name": str, "position": int, "document": int, "out_dir": str, "fingerprint": str,
         "final": int, "state": str, "started_at": float, "finished_at": float, "last_error": str},
        pk="key",
    )
    db.table("events").create({"id": int, "at": float, "kind": str, "message": str}, pk="id")


class RecipeLedger(Journal):
    """Write access to one recipe's ledger (the :class:`~resumerge.merge.store.journal.Journal` base: WAL,
    ``synchronous=FULL``, checks on open, one transaction per change, SQLite failures as StorageError or
    LedgerError). Open it with :func:`open_recipe_ledger`, which sets a damaged one aside."""

    migrations = migrations
    what = "recipe ledger"
    rebuilt_from = f"OUT's {RECIPE_MANIFEST_NAME}"
    state_table = "recipe"

    def start(self, out_dir: str, record: RecipeRecord) -> None:
        """Record ``record`` as the recipe of ``out_dir``; keeps stage rows (and their times) whose key and
        fingerprint did not change, replaces the rest, in one transaction."""
        now = time.time()
        with self._transaction():
            old = {r["key"]: r for r in self.db.table("stages").rows}
            previous = self.db.execute("SELECT created_at FROM recipe WHERE id = 1").fetchone()
            self.db.execute("DELETE FROM recipe")
            self.db.execute("DELETE FROM stages")
            self.db.table("recipe").insert({
                "id": 1, "out_dir": out_dir, "fingerprint": record.fingerprint,
                "record": json.dumps(record.to_doc(), sort_keys=True), "state": "running",
                "created_at": previous[0] if previous else now, "updated_at": now, "last_error": None,
            })
            for position, s in enumerate(record.stages):
                kept = old.get(s.key)
                same = kept is not None and kept["fingerprint"] == s.fingerprint and kept["out_dir"] == s.out_dir
                self.db.table("stages").insert({
                    "key": s.key, "name": s.name, "position": position, "document": s.document,
                    "out_dir": s.out_dir, "fingerprint": s.fingerprint, "final": int(s.final),
                    "state": kept["state"] if same and kept else "pending",
                    "started_at": kept["started_at"] if same and kept else None,
                    "finished_at": kept["finished_at"] if same and kept else None,
                    "last_error": None,
                })
            self._event("planned", f"recipe of {len(record.stages)} stages")

    def update_record(self, record: RecipeRecord) -> None:
        """Store a new version of the record document (state, intermediates)."""
        with self._transaction():
            self.db.table("recipe").update(1, {"record": json.dumps(record.to_doc(), sort_keys=True),
                                               "updated_at": time.time()})

    def stage_state(self, key: str, state: str, *, error: str | None = None) -> None:
        """Move stage ``key`` to ``state``; ``running`` stamps its start, ``done`` its finish."""
        now = time.time()
        with self._transaction():
            update: dict[str, Any] = {"state": state, "last_error": error}
            if state == "running":
                update["started_at"] = now
            if state == "done":
                update["finished_at"] = now
            self.db.table("stages").update(key, update)
            self.db.table("recipe").update(1, {"updated_at": now})
            self._event("stage", f"{key}: {state}" + (f": {error}" if error else ""))

    def event(self, kind: str, message: str) -> None:
        """Append an event."""
        with self._transaction():
            self._event(kind, message)

    def _event(self, kind: str, message: str) -> None:
        self.db.table("events").insert({"at": time.time(), "kind": kind, "message": message})


def open_recipe_ledger(path: Path) -> RecipeLedger:
    """Open the recipe ledger at ``path``. A damaged one is never trusted: it is moved aside
    (``recipe.db.damaged``) and a fresh one opened, saying so in its events. Nothing is lost that matters: the
    run records the whole recipe again (:meth:`RecipeLedger.start`), and whether a stage is done is decided by
    that stage's own ledger and checksums."""
    ledger, note = RecipeLedger.open_setting_aside(path)
    if note is not None:
        ledger.event("repair", note)
    return ledger

"""Where a merge stands, read without torch or sqlite-utils (``resumerge status`` answers in well under 0.5 s).

Reads the ledger through the standard library's sqlite3 in read-only mode, or — when the state dir is gone —
OUT's manifest. A run recorded as ``running`` whose lock no process holds is reported as ``interrupted``; an
unfinished run carries the exact command that finishes it.
"""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resumerge.config.locations import run_dir
from resumerge.errors import LedgerError
from resumerge.store.manifest import MANIFEST_NAME

# Not imported from resumerge.store.ledger: that module loads sqlite-utils, which status must not pay for.
LEDGER_NAME = "ledger.db"


@dataclass(frozen=True)
class FileStatus:
    """One planned output file."""

    name: str
    kind: str
    status: str
    bytes: int | None


@dataclass(frozen=True)
class StatusReport:
    """The state of one output directory's merge; ``source`` says whether it came from the ledger or manifest."""

    out_dir: str
    state: str
    source: str
    tensors_total: int
    tensors_done: int
    shards_total: int
    shards_done: int
    bytes_total: int
    bytes_done: int
    files: tuple[FileStatus, ...] = ()
    last_error: str | None = None
    peak_rss: int | None = None
    adaptations: int = 0
    elapsed_seconds: float | None = None
    events: tuple[str, ...] = field(default=())
    # The run's RAM budget (from its latest start), the latest governor adaptations, and for an unfinished
    # run the command that finishes it (None while done, or while another process is merging).
    budget: int | None = None
    adaptation_events: tuple[str, ...] = ()
    resume_command: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON form printed by ``status --json``."""
        doc = asdict(self)
        doc["files"] = [asdict(f) for f in self.files]
        doc["events"] = list(self.events)
        doc["adaptation_events"] = list(self.adaptation_events)
        return doc


def read_status(out_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None) -> StatusReport:
    """Status of the merge into ``out_dir``; raises :class:`LedgerError` when there is no record of one."""
    rdir = run_dir(out_dir, state_dir)
    ledger = rdir / LEDGER_NAME
    command = resume_command(out_dir, state_dir)
    manifest = Path(out_dir) / MANIFEST_NAME
    if ledger.exists():
        try:
            report = _from_ledger(ledger, rdir, str(out_dir), command)
        except LedgerError:
            if not manifest.is_file():
                raise
            report = None  # a damaged ledger is never trusted: OUT's manifest tells the same story
        if report is not None:
            return report
    if manifest.is_file():
        return _from_manifest(manifest, str(out_dir), command)
    raise LedgerError(
        f"no merge recorded for {out_dir}",
        path=str(out_dir),
        hint="pass the --state-dir used by the run, or check the output path",
    )


def resume_command(out_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str] | None = None) -> str:
    """The shell command that finishes the merge into ``out_dir`` (with ``--state-dir`` when one was given)."""
    command = f"resumerge resume {shlex.quote(os.fspath(out_dir))}"
    return command if state_dir is None else f"{command} --state-dir {shlex.quote(os.fspath(state_dir))}"


def _from_ledger(path: Path, rdir: Path, out_dir: str, command: str) -> StatusReport | None:
    from resumerge.store.runlock import is_locked

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        run = conn.execute("SELECT * FROM run WHERE id = 1").fetchone()
        if run is None:
            return None
        files = conn.execute(
            "SELECT name, kind, status, bytes, planned_bytes FROM files ORDER BY position"
        ).fetchall()
        t_total, t_done = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(status = 'done'), 0) FROM tensors"
        ).fetchone()
        events = conn.execute("SELECT kind, message FROM events ORDER BY id DESC LIMIT 8").fetchall()
        memory = conn.execute("SELECT data FROM events WHERE kind = 'memory' ORDER BY id DESC LIMIT 1").fetchone()
        adaptations = conn.execute(
            "SELECT message FROM events WHERE kind = 'adaptation' ORDER BY id DESC LIMIT 3"
        ).fetchall()
    except sqlite3.DatabaseError as exc:
        raise LedgerError(f"the ledger {path} is unreadable ({exc})", path=str(path)) from None
    finally:
        conn.close()
    state = run["state"]
    if state == "running" and not is_locked(rdir):
        state = "interrupted"
    shards = [f for f in files if f["kind"] == "shard"]
    return StatusReport(
        out_dir=out_dir,
        state=state,
        source="ledger",
        tensors_total=t_total,
        tensors_done=t_done,
        shards_total=len(shards),
        shards_done=sum(1 for f in shards if f["status"] == "done"),
        bytes_total=sum(f["planned_bytes"] or 0 for f in shards),
        bytes_done=sum(f["bytes"] or 0 for f in shards if f["status"] == "done"),
        files=tuple(FileStatus(f["name"], f["kind"], f["status"], f["bytes"]) for f in files),
        last_error=run["last_error"],
        peak_rss=run["peak_rss"] or None,
        adaptations=run["adaptations"] or 0,
        elapsed_seconds=max(0.0, (run["updated_at"] or time.time()) - (run["created_at"] or time.time())),
        events=tuple(f"{e['kind']}: {e['message']}" for e in reversed(events)),
        budget=_budget(memory["data"] if memory else None),
        adaptation_events=tuple(a["message"] for a in reversed(adaptations)),
        resume_command=None if state in ("done", "running") else command,
    )


def _budget(data: str | None) -> int | None:
    try:
        value = json.loads(data or "{}").get("budget")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def _from_manifest(path: Path, out_dir: str, command: str) -> StatusReport:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        planned = list(doc["planned"])
        committed = dict(doc["committed"])
        sizes = {str(k): int(v) for k, v in doc["shard_sizes"].items()}
        tensors_total = int(doc["tensors_total"])
        counts = {str(k): int(v) for k, v in doc["shard_tensors"].items()}
    except (ValueError, KeyError, TypeError) as exc:
        raise LedgerError(f"the manifest {path} is unreadable ({exc})", path=str(path)) from None
    shards = [n for n in planned if n in sizes]
    state = "done" if doc.get("state") == "done" else "interrupted"
    return StatusReport(
        out_dir=out_dir,
        state=state,
        source="manifest",
        tensors_total=tensors_total,
        tensors_done=sum(counts.get(n, 0) for n in shards if n in committed),
        shards_total=len(shards),
        shards_done=sum(1 for n in shards if n in committed),
        bytes_total=sum(sizes.values()),
        bytes_done=sum(int(committed[n]["bytes"]) for n in shards if n in committed),
        files=tuple(
            FileStatus(n, "shard" if n in shards else "file", "done" if n in committed else "pending",
                       committed.get(n, {}).get("bytes"))
            for n in planned
        ),
        events=("ledger not found: figures from the manifest in OUT",),
        resume_command=None if state == "done" else command,
    )

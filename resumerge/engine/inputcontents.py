"""The session's side of the content proof of local inputs (:mod:`resumerge.inputs.contents`): a run continued
from its ledger proves every recorded input file unchanged before anything is written for it, and every run
records the full sha256 of the files it has no record of before its first commit.

One rule for every kind of run, since each ends in the one session path: ``resume``, ``run`` continuing an
unfinished run of the same plan, a recipe's stages, MoE upcycling and LoRA extraction alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from resumerge.inputs.contents import Content, Hashing, check_looks, local_input_files, prove_unchanged, record_contents
from resumerge.memory import format_size
from resumerge.plan.merge_plan import Plan
from resumerge.store import killpoints
from resumerge.store.ledger import Ledger

_TELL_FROM = 1 << 30


class InputContents:
    """Made when the session has opened the run's ledger, before OUT is touched; every check and proof happens here,
    before anything is recorded for the run. Raises :class:`~resumerge.errors.PlanChangedError` (exit 4, naming
    the file) when a local input file no longer looks as it did when the plan opened it (``seen``: written while
    the merge was being planned), or when the ledger records this plan and a file no longer holds the bytes
    recorded when the run started. :meth:`record` hashes and keeps what the ledger lacks once the run is recorded
    (``open_run``), before its first commit: hashing a new run's inputs takes seconds a GB, and a run killed then
    is a recorded run that ``resume`` finishes (its files trusted by the plan's identity and hashed then, as a run
    recorded before contents were), where hashing them first left a ledger with no run in it, and ``resume``
    saying the run died planning."""

    def __init__(self, plan: Plan, ledger: Ledger, records_dir: str | os.PathLike[str] | None, *,
                 seen: Mapping[str, tuple[int, int]], restart: bool, tell: Callable[[str], None] | None = None
                 ) -> None:
        paths = local_input_files(plan.model_dirs, plan.inputs)
        check_looks(paths, seen)
        self._proved: dict[str, Content] = {}
        self._unrecorded: list[Path] = []
        self._records_dir, self._seen = records_dir, seen
        self._hashing: Hashing | None = None
        row = ledger.run_row()
        # Only a continued run's record counts: another plan's says nothing about this one's inputs.
        continuing = row is not None and row.fingerprint == plan.fingerprint
        if row is not None and not continuing and not restart:
            return  # open_run refuses the run (a merge planned differently): nothing to hash for it
        hashing = self._hashing = _telling(tell) if tell is not None else None
        recorded = {p: Content(*c) for p, c in ledger.input_contents().items()} if continuing else {}
        ours = {str(p) for p in paths}
        self._proved = prove_unchanged({p: c for p, c in recorded.items() if p in ours}, records_dir, hashing)
        # A run recorded before contents were (or by a process killed before recording them: then with no file
        # committed) is trusted by the plan's identity, as it was then, and its files are recorded now.
        self._unrecorded = [p for p in paths if str(p) not in recorded]

    def record(self, ledger: Ledger, notes: list[str]) -> None:
        """Hash and record the content of every file the ledger had no record of (raises
        :class:`~resumerge.errors.PlanChangedError` for one that no longer looks as the plan saw it), and record
        the new look of those proved unchanged (``notes`` says which were)."""
        if self._proved:
            notes.append(touched_note(self._proved))
        killpoints.reach("before_input_hashing")  # the run is recorded: a kill here is one resume finishes
        found = {**record_contents(self._unrecorded, self._records_dir, self._seen, self._hashing), **self._proved}
        if found:
            ledger.record_input_contents({p: (c.size, c.mtime_ns, c.ctime_ns, c.sha256) for p, c in found.items()})


def touched_note(proved: Mapping[str, object]) -> str:
    """The line saying that the files ``proved`` (paths) were touched but hold the bytes they held: by folder (two
    models' shards share their names), each name once."""
    folders: dict[str, list[str]] = {}
    for path in sorted(proved):
        folders.setdefault(str(Path(path).parent), []).append(Path(path).name)
    listed = "; ".join(f"{folder}: {_names(names)}" for folder, names in folders.items())
    plural = "s" if len(proved) != 1 else ""
    return (f"{len(proved)} input file{plural} touched since the run started (a time or a mode changed) hold the "
            f"bytes they held then, proved by hashing them again — {listed}")


def _names(names: list[str]) -> str:
    """``names`` of one folder, the first and last of a long list."""
    if len(names) <= 3:
        return ", ".join(names)
    return f"{len(names)} files, {names[0]} … {names[-1]}"


def _telling(tell: Callable[[str], None]) -> Hashing:
    """What the user hears before input files are hashed, when that takes seconds (a GiB and more)."""

    def hashing(files: int, size: int) -> None:
        if size >= _TELL_FROM:
            plural = "s" if files != 1 else ""
            tell(f"hashing {files} input file{plural} ({format_size(size)}) so that a resume can prove them unchanged")

    return hashing

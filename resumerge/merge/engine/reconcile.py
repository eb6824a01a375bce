"""Make OUT agree with the ledger before work continues, and rebuild a lost ledger from OUT's manifest.

Rules (crash-consistency.md §1): a committed file whose bytes still hash to the recorded checksum is kept; a
committed file that is missing, truncated or altered is reopened and rebuilt; a planned name with no committed
record is garbage from an interrupted commit and is deleted, as are resumerge's own temp files. Nothing else
in OUT is ever touched.

A file written in place, unit by unit (:mod:`resumerge.merge.store.units`), keeps each journaled unit whose bytes still
hash to its record and has the others written again; its in-place file is deleted once no unit of it is kept. A
process killed between renaming it to its final name and its ledger row left the complete file under that name:
it is moved back and its units checked like the others, rather than deleted.
"""

from __future__ import annotations

from collections.abc import Mapping

from resumerge.machine.durable import is_temp_name
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import MANIFEST_NAME, ManifestBook
from resumerge.merge.store.sink import OutputSink
from resumerge.merge.store.units import check_units, is_partial_name, partial_name


def reconcile(sink: OutputSink, ledger: Ledger, book: ManifestBook, *, log: list[str],
              verified: frozenset[str] = frozenset(), in_place: bool = False) -> None:
    """Verify committed files, reopen damaged ones, delete uncommitted planned files and temp files.

    ``verified`` names files already re-hashed by this process (a ledger just rebuilt from the manifest), which
    are not hashed a second time. ``in_place``: this run writes files planned in units in place (else their units
    written by an earlier run are given up, and their in-place files deleted).
    """
    rows = ledger.files()
    planned = {r.name for r in rows}
    committed = [r for r in rows if r.status == "done" and r.name not in verified]
    # commit_file records both size and checksum; a row without them fails the check and is rebuilt
    problems = sink.check((r.name, r.bytes or 0, r.sha256 or "") for r in committed)
    for row in committed:
        problem = problems[row.name]
        if problem:
            log.append(f"{row.name} {problem}: rebuilding it")
            ledger.reopen_file(row.name, problem)
            sink.delete([row.name])
            book.drop(row.name)
    if in_place:
        _reconcile_units(sink, ledger, log)
    else:
        _give_up_units(ledger)
    done = {r.name for r in ledger.files() if r.status == "done"}
    # The in-place files that hold a unit kept; any other is garbage (a file not begun, or committed since).
    writing = {partial_name(u.file) for u in ledger.units() if u.status == "done" and u.file not in done}
    sink.delete(name for name in sink.names()
                if is_temp_name(name, planned | {MANIFEST_NAME}) or (name in planned and name not in done)
                or (is_partial_name(name, planned) and name not in writing))


def _give_up_units(ledger: Ledger) -> None:
    """Reopen the units written of every file not committed: this run writes each file whole."""
    done = {r.name for r in ledger.files() if r.status == "done"}
    written: dict[str, list[int]] = {}
    for row in ledger.units():
        if row.status == "done" and row.file not in done:
            written.setdefault(row.file, []).append(row.index)
    for name, indices in sorted(written.items()):
        ledger.reopen_units(name, indices, "this run writes the file whole (an hf:// or staged OUT, or the ray "
                                           "executor)")


def _reconcile_units(sink: OutputSink, ledger: Ledger, log: list[str]) -> None:
    """Re-hash the journaled units of every file written in place and not committed; reopen those whose bytes
    differ (or are gone), and say what is kept."""
    done = {r.name for r in ledger.files() if r.status == "done"}
    units: dict[str, list[tuple[int, int, int, str]]] = {}
    for row in ledger.units():
        if row.status == "done" and row.file not in done:
            units.setdefault(row.file, []).append((row.index, row.start, row.end, row.sha256 or ""))
    for name, rows in sorted(units.items()):
        path = sink.partial_for(name)
        if not path.exists() and sink.where(name).is_file():  # renamed, not yet journaled as a whole
            sink.reclaim(name)
        problems = check_units(path, rows)
        bad = sorted(i for i, problem in problems.items() if problem)
        if bad:
            first = problems[bad[0]]
            log.append(f"{name}: {first}: writing {len(bad)} of its units again")
            ledger.reopen_units(name, bad, str(first))
        kept = len(rows) - len(bad)
        if kept:
            total = len(ledger.units(name))
            log.append(f"{name}: {kept} of {total} units kept (each re-hashed against its checksum)")


def adopt_manifest(sink: OutputSink, plan: Plan, ledger: Ledger, committed: Mapping[str, Mapping[str, object]],
                   log: list[str], *, rebuilt: bool = True) -> frozenset[str]:
    """Mark the manifest's committed files done in the ledger (a fresh one when ``rebuilt``), after checking each.

    Returns the names found intact (so the caller need not hash them again).
    """
    intact = set()
    problems = sink.check((n, int(str(i["bytes"])), str(i["sha256"])) for n, i in committed.items())
    for name, info in sorted(committed.items()):
        size, sha = int(str(info["bytes"])), str(info["sha256"])
        problem = problems[name]
        if problem:
            log.append(f"{name} {problem}: rebuilding it")
            continue
        shard = next((s for s in plan.shards if s.name == name), None)
        ledger.commit_file(name, size=size, sha256=sha, seconds=0.0, tensors=shard.tensors if shard else ())
        intact.add(name)
    if rebuilt:
        log.append(f"ledger rebuilt from {MANIFEST_NAME}")
    elif intact:
        log.append(f"{', '.join(sorted(intact))}: committed with {MANIFEST_NAME} before the process stopped")
    return frozenset(intact)

"""``verify``: re-hash every committed output file against its recorded checksum (by the algorithm the record names:
:mod:`resumerge.machine.checksums`) and report, never repair; OUT's manifest is judged by the run's ledger
(:mod:`resumerge.merge.store.manifestcheck`); a file written in place, unit by unit (a GGUF output), is re-hashed per
unit, so that a damaged one names the units that differ and the units of one not complete yet are checked too
(:mod:`resumerge.merge.store.units`); a finished output stored quantized whose every file matched is also read as a
loader reads it (every weight with its companions, the role counts the run planned:
:mod:`resumerge.merge.store.formatcheck`). Checksums come first: a file that fails its own is reported damaged and never
parsed.

Like huggingface_hub's cache scan, problems are collected into a report rather than raised one by one, so a
single damaged shard does not hide another. ``resume`` repairs what the report lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.config.hubtarget import is_hub_target
from resumerge.config.locations import StateDir
from resumerge.errors import LedgerError, NothingRecordedError
from resumerge.inputs.codecs import CODECS, CodecTable
from resumerge.machine.checksums import check_many
from resumerge.merge.store.formatcheck import check_formats
from resumerge.merge.store.ledger_read import LEDGER_NAME, read_formats, read_merge_record, read_unit_rows
from resumerge.merge.store.manifest import MANIFEST_NAME, read_manifest
from resumerge.merge.store.manifestcheck import manifest_problem, read_facts
from resumerge.merge.store.outgone import refuse_gone
from resumerge.merge.store.units import check_units, partial_name
from resumerge.outputs.containers import container_of


@dataclass(frozen=True)
class Damage:
    """A committed file whose bytes no longer match its record."""

    name: str
    problem: str


@dataclass(frozen=True)
class VerifyReport:
    """Files checked, committed bytes checked, and every damaged file found."""

    out_dir: str
    checked: int
    bytes_checked: int
    pending: int
    damaged: tuple[Damage, ...]
    # A finished local output stored quantized: its format and role counts as its shards' headers hold them
    # (see resumerge.merge.store.formatcheck), and as the run planned them; None otherwise.
    formats: dict[str, Any] | None = None
    # The command that repairs it (resume_command's: with the run's --state-dir when not the default).
    resume_command: str = ""
    # Units written in place of files not complete yet, re-hashed too (their bytes are in ``bytes_checked``).
    units_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when every committed file is intact."""
        return not self.damaged


def verify_output(out_dir: str | os.PathLike[str], state: StateDir, codecs: CodecTable = CODECS) -> VerifyReport:
    """Check the committed files of ``out_dir`` (records from its ledger under ``state``, else the manifest); a
    quantized output is read back by its recorded format in ``codecs`` (the run's table of stored formats).

    For an ``hf://`` OUT the records come from this machine's ledger, else the repo's manifest, and each file is
    checked against the hub's checksums (the sha256 of the tree listing for LFS files; small files read back).
    """
    problems: Mapping[str, str | None]
    units = 0
    if is_hub_target(out_dir):
        from resumerge.merge.store.hubstatus import check_committed, manifest_records

        command = state.resume_command(out_dir)
        found = _ledger_records(state.run_dir(out_dir) / LEDGER_NAME, None)
        records, pending = found if found is not None else manifest_records(str(out_dir), command)
        problems = check_committed(str(out_dir), records, command)
    else:
        out = Path(out_dir)
        records, pending = _records(out, state)
        refuse_gone(out, len(records), state)  # what resume and status say of a missing OUT, not N "missing"
        problems = check_many(out, ((name, size, sha) for name, (size, sha) in records.items()))
    damaged = [Damage(name, problem) for name in sorted(records) if (problem := problems[name])]
    total = sum(size for size, _ in records.values())
    if not is_hub_target(out_dir):
        damaged, total, units = _by_unit(Path(out_dir), state.run_dir(out_dir) / LEDGER_NAME, damaged, total)
    formats = None
    if not is_hub_target(out_dir):
        facts = read_facts(state.run_dir(out_dir) / LEDGER_NAME)
        if facts is not None and facts.record.files and (problem := manifest_problem(Path(out_dir), facts)):
            damaged.append(Damage(MANIFEST_NAME, problem))
    shards = [n for n in records if n.endswith(".safetensors")]
    read = {"config.json", *shards}
    # The container's rule: a GGUF's format is in its own header, re-hashed above; safetensors are read as a
    # loader reads them.
    loader_readable = container_of(records).loader_readable
    if not is_hub_target(out_dir) and not pending and loader_readable and not any(d.name in read for d in damaged):
        # Every weight with its companions, as a reader finds them (a hub OUT's headers would cost a download).
        # Only files whose checksums matched are read: a damaged one is reported as damaged, never parsed.
        recorded = read_formats(state.run_dir(out_dir) / LEDGER_NAME)
        held, wrong = check_formats(Path(out_dir), shards, recorded, codecs)
        damaged += [Damage(name, problem) for name, problem in wrong]
        if held is not None or recorded is not None:
            formats = {"found": held, "planned": recorded.get("output") if recorded else None}
    return VerifyReport(str(out_dir), len(records), total, pending, tuple(damaged), formats,
                        state.resume_command(out_dir), units)


def _by_unit(out: Path, ledger: Path, damaged: list[Damage], total: int) -> tuple[list[Damage], int, int]:
    """``damaged`` and ``total`` (committed bytes checked) with the units of the files written in place re-hashed
    (:mod:`resumerge.merge.store.units`): a damaged committed file names the units that differ, and the units written
    of a file not complete yet are checked in its in-place file (how many: the third value)."""
    try:
        rows = read_unit_rows(ledger) if ledger.exists() else ()
    except LedgerError:
        return damaged, total, 0  # the manifest's records were checked: no unit is known
    units: dict[str, list[tuple[int, int, int, str]]] = {}
    for row in rows:
        if row.status == "done":
            units.setdefault(row.file, []).append((row.index, row.start, row.end, row.sha256 or ""))
    found = {d.name: d for d in damaged}
    partial: list[Damage] = []
    checked = 0
    for name, written in sorted(units.items()):
        if name in found:  # committed and damaged: which units
            problems = check_units(out / name, written)
            bad = [str(p) for _, p in sorted(problems.items()) if p]
            if bad and (out / name).is_file():
                found[name] = Damage(name, f"{found[name].problem}: {'; '.join(bad)}")
        elif not (out / name).is_file():  # written in place, not complete yet: each unit written so far
            problems = check_units(out / partial_name(name), written)
            partial += [Damage(name, f"{p} (written in place, not complete yet)")
                        for _, p in sorted(problems.items()) if p]
            total += sum(end - start for _, start, end, _ in written)
            checked += len(written)
    return [found.get(d.name, d) for d in damaged] + partial, total, checked


def _ledger_records(ledger: Path, manifest: Path | None) -> tuple[dict[str, tuple[int, str]], int] | None:
    """The ledger's committed files and pending count; None without a usable ledger (a damaged one is never
    trusted when ``manifest`` exists, or for a hub OUT, whose repo manifest can stand in)."""
    if not ledger.exists():
        return None
    try:
        record = read_merge_record(ledger)
    except LedgerError:
        if manifest is not None and not manifest.is_file():
            raise
        return None
    if record is None or not record.files:
        return None
    done = {f.name: (int(f.bytes or 0), str(f.sha256)) for f in record.files if f.status == "done"}
    return done, len(record.files) - len(done)


def _records(out: Path, state: StateDir) -> tuple[dict[str, tuple[int, str]], int]:
    found = _ledger_records(state.run_dir(out) / LEDGER_NAME, out / MANIFEST_NAME)
    if found is not None:
        return found
    manifest = read_manifest(out)
    if manifest is None:
        raise NothingRecordedError.of(out)
    done = {k: (int(v["bytes"]), str(v["sha256"])) for k, v in manifest.committed.items()}
    return done, len(manifest.planned) - len(done)


def report_json(report: VerifyReport) -> str:
    """The report as JSON text."""
    return json.dumps(
        {
            "out_dir": report.out_dir,
            "ok": report.ok,
            "checked": report.checked,
            "bytes_checked": report.bytes_checked,
            "pending": report.pending,
            "units_checked": report.units_checked,
            "damaged": [{"name": d.name, "problem": d.problem} for d in report.damaged],
            **({"formats": report.formats} if report.formats is not None else {}),
        },
        indent=2,
    )

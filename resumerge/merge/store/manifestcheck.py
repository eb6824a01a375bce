"""OUT's manifest judged by the run's ledger: the one file in OUT with no checksum of its own is checked too.

The manifest carries no timestamps: every byte of it follows from what the run's ledger records (the plan's
record, the committed files and whether the run finished), so with the ledger at hand a damaged, altered or
deleted manifest is found like any damaged output file (``verify`` names it) and rewritten like one (a run or a
resume writes it again from the ledger). Without the ledger — a fresh machine, the state dir lost — the manifest
is the only record of the run: one that cannot be read leaves nothing in OUT that can be checked or trusted, and
the refusal says so (:func:`~resumerge.merge.store.manifest.parse_manifest`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from resumerge.errors import LedgerError
from resumerge.machine.durable import is_temp_name
from resumerge.merge.store.ledger_read import ManifestFacts, read_manifest_facts, read_merge_record
from resumerge.merge.store.manifest import DECODE_ERRORS, MANIFEST_NAME, Manifest, decode_manifest, read_manifest


def ledger_manifest(facts: ManifestFacts, state: str) -> Manifest:
    """The manifest the run recorded in ``facts`` writes with the files its ledger holds committed, in ``state``
    (``running`` or ``done``) — what :func:`~resumerge.merge.engine.outdir.fresh_manifest` made from the plan."""
    run, files = facts.record.run, facts.record.files
    return Manifest(
        version=facts.version, fingerprint=run.fingerprint, parts=run.parts, inputs=run.inputs, options=run.options,
        model_dirs=run.model_dirs, config_text=run.config_text, planned=tuple(f.name for f in files),
        shard_sizes={f.name: int(f.planned_bytes or 0) for f in files if f.kind == "shard"},
        shard_tensors=dict(facts.shard_tensors), tensors_total=facts.tensors_total,
        committed={f.name: {"bytes": int(f.bytes or 0), "sha256": str(f.sha256)} for f in files if f.status == "done"},
        state=state)


def manifest_problem(out: Path, facts: ManifestFacts) -> str | None:
    """Why OUT's manifest is not the one the run recorded in ``facts`` wrote (None: it is).

    A finished run (its ledger says ``done``) has written exactly :func:`ledger_manifest`. An unfinished one may
    have been stopped between a ledger row and the manifest write that follows it (a file committed but not yet
    listed, or reopened for repair but still listed, or the manifest marked done just before the ledger): there
    every other field must match, and each file listed must be listed with the ledger's record or still be
    planned."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return "missing"
    data = path.read_bytes()
    try:
        found = decode_manifest(data)
    except DECODE_ERRORS as exc:
        return f"cannot be read ({exc})"
    if facts.record.run.state == "done":
        expected = ledger_manifest(facts, "done")
    else:
        expected = replace(ledger_manifest(facts, found.state), committed=found.committed)
        done = ledger_manifest(facts, "running").committed
        stray = sorted(name for name, entry in found.committed.items()
                       if (name in done and dict(entry) != dict(done[name])) or name not in expected.planned)
        if found.state not in ("running", "done") or stray:
            return _differs(data, ledger_manifest(facts, found.state).to_bytes())
    # an OUT finished by an earlier resumerge holds this machine's folders as model_dirs: the same run, not damage
    return None if data in (expected.to_bytes(), expected.to_bytes(published=False)) else _differs(
        data, expected.to_bytes())


def _differs(data: bytes, expected: bytes) -> str:
    """What differs between the manifest bytes ``data`` and the ``expected`` ones, in a few words."""
    doc, want = json.loads(data), json.loads(expected)
    keys = sorted(k for k in set(doc) | set(want) if doc.get(k) != want.get(k))
    if not keys:
        return "is not laid out as resumerge writes it"
    return f"its {', '.join(keys)} differ{'s' if len(keys) == 1 else ''} from what the run's ledger records"


def read_facts(ledger: Path) -> ManifestFacts | None:
    """The :class:`ManifestFacts` of the ledger at ``ledger``; None when there is none or it cannot be read (a
    damaged ledger is never trusted: OUT's manifest is then the record)."""
    if not ledger.is_file():
        return None
    try:
        return read_manifest_facts(ledger)
    except LedgerError:
        return None


def ledger_vouches(out: Path, ledger: Path) -> bool:
    """Whether the run's ledger at ``ledger`` shows OUT is resumerge's without its manifest: it records a run into
    OUT, and OUT holds one of its committed files at the size it was committed with, or nothing but the manifest
    and resumerge's temp files (a run stopped before its first file). The ledger's place is derived from OUT's
    real path, so it speaks of this folder only."""
    if not ledger.is_file():
        return False
    try:
        record = read_merge_record(ledger)
    except LedgerError:
        return False
    if record is None:
        return False
    for row in record.files:
        path = out / row.name
        if row.status == "done" and path.is_file() and not path.is_symlink() and path.stat().st_size == row.bytes:
            return True
    planned = {r.name for r in record.files} | {MANIFEST_NAME}
    return all(p.name == MANIFEST_NAME or is_temp_name(p.name, planned) for p in out.iterdir())


def manifest_or_ledger(out: Path, ledger: Path) -> Manifest | None:
    """OUT's manifest; None when OUT has none, or when it cannot be read but the ledger at ``ledger``
    :func:`vouches <ledger_vouches>` for OUT (the run writes it again from the ledger, as it rebuilds any damaged
    file). Raises the :class:`LedgerError` of a manifest that cannot be read otherwise."""
    try:
        return read_manifest(out)
    except LedgerError:
        if ledger_vouches(out, ledger):
            return None
        raise

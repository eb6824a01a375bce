"""Replace one committed small file of a finished local output after the run (the model card, once a check adds
its section), by the same protocol as every output file: temp, fsync, rename, fsync dir, then the ledger row, then
the manifest. ``verify`` then passes with the new bytes, and a later ``resume`` keeps them.

A file is replaced only when resumerge's record (the run's ledger, else OUT's manifest when the state dir is lost)
holds it committed and its bytes on disk still match that record: a file resumerge did not write, or one a person
edited since, is never touched. The run's lock is held throughout, so a merge into OUT never runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from resumerge.config.locations import StateDir
from resumerge.errors import LedgerError, OutputDirError
from resumerge.machine.checksums import matches, written_with
from resumerge.machine.durable import write_file_atomic
from resumerge.machine.runlock import RunLock
from resumerge.merge.store.ledger_read import LEDGER_NAME, read_merge_record
from resumerge.merge.store.manifest import ManifestBook, read_manifest
from resumerge.merge.store.sink import LocalDirSink


@dataclass(frozen=True)
class Committed:
    """Committed file ``name`` of OUT as resumerge recorded it, and its bytes now (None: they no longer match the
    record, or it is missing); ``ledger``: whether the run's ledger holds the record (else OUT's manifest)."""

    name: str
    size: int
    sha256: str
    data: bytes | None
    ledger: bool


def committed_file(out: Path, name: str, state: StateDir) -> Committed | None:
    """What resumerge recorded of file ``name`` of ``out`` (None: no record holds it committed, so resumerge did
    not write it, or ``out`` is no resumerge output). Raises :class:`LedgerError` for a manifest that cannot be
    read where no ledger stands in."""
    ledger = state.run_dir(out) / LEDGER_NAME
    record: tuple[int, str] | None = None
    in_ledger = False
    if ledger.is_file():
        try:
            merge = read_merge_record(ledger)
        except LedgerError:
            merge = None
        if merge is not None and merge.files:
            in_ledger = True
            row = next((f for f in merge.files if f.name == name and f.status == "done"), None)
            record = (int(row.bytes or 0), str(row.sha256)) if row is not None else None
    if not in_ledger:
        manifest = read_manifest(out)
        entry = manifest.committed.get(name) if manifest is not None else None
        record = (int(entry["bytes"]), str(entry["sha256"])) if entry is not None else None
    if record is None:
        return None
    path = out / name
    data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    if data is not None and (len(data) != record[0] or not matches(data, record[1])):
        data = None
    return Committed(name, record[0], record[1], data, in_ledger)


def recommit_small(out: Path, found: Committed, data: bytes, state: StateDir) -> bool:
    """Replace committed file ``found`` of ``out`` with ``data`` and record it (ledger row and manifest, or the
    manifest alone when ``found`` came from it); False when the run's lock is held (a merge into OUT is running)
    or OUT's manifest is gone, and nothing was written. Raises :class:`~resumerge.errors.StorageError` for a disk
    that refuses the write."""
    lock = RunLock(state.run_dir(out), out)
    try:
        lock.acquire()
    except OutputDirError:
        return False
    try:
        manifest = read_manifest(out)
        if manifest is None or found.name not in manifest.committed:
            return False
        sink = LocalDirSink(out)
        book = ManifestBook(sink, manifest)
        if not found.ledger:  # the state dir is lost: OUT's manifest is the only record
            write_file_atomic(out / found.name, data)
            book.commit(found.name, len(data), written_with(found.sha256).of(data))  # the kind it was recorded with
            return True
        # imported only here: the ledger's writer brings sqlite-utils, which a check of a model that is no
        # resumerge output (or whose card is up to date) never needs, and every check imports this module
        from resumerge.merge.store.journal_commit import CommitJournal
        from resumerge.merge.store.ledger import Ledger

        ledger = Ledger(state.run_dir(out) / LEDGER_NAME)
        try:
            CommitJournal(sink, ledger, book).write_small(found.name, data)
        finally:
            ledger.close()
        return True
    finally:
        lock.release()

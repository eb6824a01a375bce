"""Open OUT for a run: refuse what resumerge did not write, decide between continuing, rebuilding the ledger from
the manifest, refusing a changed plan or starting over (``--restart``), and record the plan.

Nothing here computes a tensor; the session calls :func:`open_run` once, before reconcile and the engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resumerge.config.version import __version__
from resumerge.config.yamldiff import config_changes
from resumerge.errors import OutputDirError, PlanChangedError, UsageError
from resumerge.machine.diskprobe import free_bytes, unwritable
from resumerge.machine.durable import is_temp_name
from resumerge.machine.memory import format_size
from resumerge.merge.engine.reconcile import adopt_manifest
from resumerge.merge.plan.changes import describe_changes, local_files, recorded_options
from resumerge.merge.plan.merge_plan import Plan, fingerprint_parts
from resumerge.merge.plan.sidefiles import aux_files
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.manifest import MANIFEST_NAME, Manifest, ManifestBook, read_manifest
from resumerge.merge.store.manifestcheck import ledger_vouches, manifest_or_ledger
from resumerge.merge.store.sink import OutputSink

# Makes the stored form of the run's plan, (key, bytes), or None when it is not stored.
Frozen = Callable[[], "tuple[str, bytes] | None"]


@dataclass(frozen=True)
class EarlierRun:
    """What the command asked of a run OUT may hold already: ``restart`` discards one planned differently and starts
    over; ``resuming`` says the command continues one (``resume``), so a changed plan is refused with its hint."""

    restart: bool = False
    resuming: bool = False


@dataclass(frozen=True)
class Recording:
    """How a new run's plan is recorded (:func:`record_plan`): as a run of ``kind``, with the plan's stored form when
    ``frozen`` makes one (:func:`resumerge.merge.engine.frozenplan.freeze`: a resume reloads it instead of planning),
    and, ``in_place`` (the sink writes files in place: :mod:`resumerge.merge.store.units`), the units of each file the
    plan has written so (a GGUF output's)."""

    kind: str
    frozen: Frozen | None = None
    in_place: bool = False


def open_run(
    plan: Plan,
    config_text: str,
    out: Path | str,  # a directory, or an hf:// repo as the user wrote it
    sink: OutputSink,
    ledger: Ledger,
    manifest: Manifest | None,
    earlier: EarlierRun,
    *,
    notes: list[str],
    recording: Recording,
) -> tuple[ManifestBook, frozenset[str]]:
    """Decide between continuing, rebuilding the ledger, refusing, or starting over.

    Returns the manifest book and the files this call already re-hashed (when the ledger was rebuilt). A plan
    recorded now is recorded as ``recording`` says (:func:`record_plan`).
    """
    row = ledger.run_row()
    if refuse_changed_plan(plan, out, ledger, manifest, earlier, config_text=config_text):
        _clean_previous(sink, ledger, manifest)
        notes.append("previous run in OUT discarded (--restart)")
        row, manifest = None, None
    verified: frozenset[str] = frozenset()
    if row is None and manifest is None and isinstance(out, Path):
        check_room(plan, out)
    if row is None:
        record_plan(plan, config_text, out, ledger, recording)
        if manifest is not None:
            # The state dir was lost (a runtime reset) but OUT survived: trust only what re-hashes correctly.
            verified = adopt_manifest(sink, plan, ledger, manifest.committed, notes)
    elif manifest is not None:
        # A sink that commits in batches (a hub repo) commits a file with the manifest before its ledger row: a
        # process killed in between left files the manifest lists and the ledger does not. Adopt them after a check.
        pending = {r.name for r in ledger.files() if r.status != "done"}
        missed = {name: info for name, info in manifest.committed.items() if name in pending}
        if missed:
            verified = adopt_manifest(sink, plan, ledger, missed, notes, rebuilt=False)
    remember_files(plan, ledger)
    committed = {
        r.name: {"bytes": r.bytes, "sha256": r.sha256} for r in ledger.files() if r.status == "done"
    }
    book = ManifestBook(sink, fresh_manifest(plan, config_text, committed))
    book.set_state("running")
    return book, verified


# The ledger's event saying where this machine reads the files the run is given by path (--imatrix, --imatrix-texts):
# what a resume here reads them from. OUT's manifest names them by base name and digest alone (recorded_options).
FILES_READ = "files-read"


def remember_files(plan: Plan, ledger: Ledger) -> None:
    """Record in ``ledger`` where this machine reads the files ``plan`` is given by path, where a run (a new one, or
    one continued with a file given again from another place) reads them elsewhere than the ledger last said."""
    found = local_files(plan.options)
    if found and ledger.last_event_data(FILES_READ) != found:
        ledger.event(FILES_READ, f"the run reads {', '.join(found.values())}", found)


def check_room(plan: Plan, out: Path) -> None:
    """Refuse (UsageError, exit 2, before a byte is written) a new run whose shards alone need more than the disk
    of ``out`` has free — what ``plan`` reports as "will not fit". A disk that fills later, for other reasons,
    still stops the run with a StorageError (exit 3) that ``resume`` finishes."""
    free = free_bytes(out)
    if plan.total_bytes > free:
        raise UsageError(
            f"the output needs {format_size(plan.total_bytes)} on the disk of {out}, but only {format_size(free)} "
            "is free", path=str(out),
            hint=f"free {format_size(plan.total_bytes - free)} there or choose an OUT on a disk with more room "
                 "(resumerge plan CONFIG OUT tells what a run needs)")


def refuse_changed_plan(plan: Plan, out: Path | str, ledger: Ledger, manifest: Manifest | None, earlier: EarlierRun,
                        *, config_text: str | None = None) -> bool:
    """Whether the ledger (or, without one, OUT's manifest) records a plan other than ``plan``: with ``restart`` the
    caller starts over; without, :class:`PlanChangedError` (exit 4) says what changed (with ``config_text``, the
    config's keys and values that changed). Called before anything is written for the new plan — before a missing
    repo is created too."""
    row = ledger.run_row()
    recorded = row.fingerprint if row else (manifest.fingerprint if manifest else None)
    recorded_text = row.config_text if row else (manifest.config_text if manifest else None)
    # The card and the config's copy are written from the text as given (its name, its comments): a run continued
    # with another text, however alike its plan, would finish with other words than the run it continues.
    other_text = (plan.options.write_model_card and config_text is not None and recorded_text is not None
                  and config_text != recorded_text)
    if recorded is None or (recorded == plan.fingerprint and not other_text):
        return False
    parts = row.parts if row else dict(manifest.parts if manifest else {})
    inputs = row.inputs if row else dict(manifest.inputs if manifest else {})
    if earlier.restart:
        return True
    options = row.options if row else dict(manifest.options if manifest else {})
    configs = (recorded_text, config_text) if recorded_text is not None and config_text is not None else None
    what = "; ".join(describe_changes(parts, inputs, plan, recorded_options=options, configs=configs)
                     or _text_change(configs) or ["the plan changed"])
    raise PlanChangedError(
        f"{out} holds a merge planned differently: {what}",
        path=str(out),
        hint="resume it unchanged, use another OUT, or pass --restart to start over"
        if not earlier.resuming
        else "restore the inputs as they were, or start over with resumerge run CONFIG OUT --restart",
    )


def _text_change(configs: tuple[str, str] | None) -> list[str]:
    """What differs between the recorded text and a continued run's where their plans are alike: the keys and
    values (a config's ``name``), else the text alone (a comment, the layout)."""
    if configs is None or configs[0] == configs[1]:
        return []
    told = [f"config: {c}" for c in config_changes(*configs)]
    return told or ["the config's text changed (a comment or the layout), which the model card and the config's "
                    "copy show as given"]


def fresh_manifest(plan: Plan, config_text: str, committed: dict[str, Any] | None = None) -> Manifest:
    """The manifest of a run of ``plan`` with ``committed`` files (the fingerprint parts are those the planner kept
    on the plan: :func:`~resumerge.merge.plan.merge_plan.fingerprint_parts`)."""
    return Manifest(
        version=__version__,
        fingerprint=plan.fingerprint,
        parts=fingerprint_parts(plan),
        inputs={k: [list(f) for f in v] for k, v in plan.inputs.items()},
        options=recorded_options(plan.options),
        model_dirs=dict(plan.model_dirs),
        config_text=config_text,
        planned=tuple(planned_files(plan)),
        shard_sizes={s.name: s.file_size for s in plan.shards},
        shard_tensors={s.name: len(s.tensors) for s in plan.shards},
        tensors_total=len(plan.tensors),
        committed=dict(committed or {}),
    )


def done_line(out: str, files: int, resumed: int, seconds: float | None, detail: str | None) -> str:
    """A finished run in one line: ``done: OUT, 8 files, 3 resumed, 6.1 s`` (with ``detail``, a recipe's
    stages, before the time)."""
    parts = [f"{files} files", f"{resumed} resumed", *([detail] if detail else []),
             *([f"{seconds:.1f} s"] if seconds is not None else [])]
    return f"done: {out}, {', '.join(parts)}"


def planned_files(plan: Plan) -> list[str]:
    return [s.name for s in plan.shards] + [a.name for a in aux_files(plan)]


def record_plan(plan: Plan, config_text: str, out: Path | str, ledger: Ledger, recording: Recording) -> None:
    """Record ``plan`` in ``ledger`` as a new run into OUT (every file pending), as ``recording`` says."""
    frozen = recording.frozen
    files: list[tuple[str, str, int, int, int | None]] = [
        (s.name, "shard", i, len(s.tensors), s.file_size) for i, s in enumerate(plan.shards)
    ]
    files += [(a.name, a.kind, len(files) + i, 0, None) for i, a in enumerate(aux_files(plan))]
    ledger.start_run(
        str(out), recording.kind, fresh_manifest(plan, config_text),
        files=files,
        tensors=[(t.name, t.shard, t.nbytes) for t in plan.tensors.values()],
        frozen=frozen() if frozen is not None else None,
        units=[(s.name, i, start, end, names) for s in plan.shards
               for i, (start, end, names) in enumerate(plan.file_units(s))]
        if recording.in_place else (),
    )


def _clean_previous(sink: OutputSink, ledger: Ledger, manifest: Manifest | None) -> None:
    """Delete the files the previous run planned (and only those) before starting over."""
    names = {r.name for r in ledger.files()} | set(manifest.planned if manifest else ())
    sink.delete(name for name in sorted(names) if "/" not in name)


def check_out_path(out: Path, *, resuming: bool = False) -> None:
    """Refuse (exit 2) an OUT that is a symbolic link or not a directory (``resuming``: the OUT of a resume,
    whose file is most often the config given instead).

    A link could point elsewhere on the next run, and the lock, the state dir and "never touch what resumerge did
    not write" all concern one directory: the user passes the real one instead.
    """
    if out.is_symlink():
        raise UsageError(f"{out} is a symbolic link", path=str(out),
                         hint=f"pass the directory itself: {os.path.realpath(out)}")
    if not out.exists() and (why := unwritable(out, "OUT", "choose an OUT on a writable filesystem")):
        # Created once the plan is recorded, before any weight is written: said here, not as mkdir's OSError.
        raise UsageError(why, path=str(out))
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory", path=str(out),
                         hint="resume takes the output folder a run wrote into (its OUT), not the run's config"
                         if resuming else "choose a new or empty directory for the output")


def check_out_dir(out: Path, *, tolerate: frozenset[str] = frozenset(), ledger: Path | None = None) -> Manifest | None:
    """OUT's manifest, or None when OUT is absent or empty (bar ``tolerate``) — or when its manifest is deleted or
    damaged but the run's ``ledger`` vouches for OUT (:func:`~resumerge.merge.store.manifestcheck.ledger_vouches`): the
    run then writes it again from the ledger, as it rebuilds any damaged output file.

    Raises :class:`UsageError` (exit 2) for a link or a file, :class:`OutputDirError` (exit 4) for a non-empty
    folder without resumerge's manifest, :class:`LedgerError` (exit 4) for a damaged manifest no ledger vouches
    for."""
    check_out_path(out)
    if not out.exists():
        return None
    manifest = read_manifest(out) if ledger is None else manifest_or_ledger(out, ledger)
    # A process killed inside its first manifest write leaves only that temp file: still resumerge's OUT.
    ours = {MANIFEST_NAME, *tolerate}
    if (manifest is None and any(p.name not in tolerate and not is_temp_name(p.name, ours) for p in out.iterdir())
            and not (ledger is not None and ledger_vouches(out, ledger))):
        raise OutputDirError(
            f"{out} is not empty and was not written by resumerge (no {MANIFEST_NAME})",
            path=str(out),
            hint="choose an empty or new output directory; resumerge never overwrites files it did not write",
        )
    return manifest

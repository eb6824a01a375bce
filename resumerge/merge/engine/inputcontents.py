"""The session's side of the content proof of local inputs (:mod:`resumerge.inputs.contents`): a run continued
from its ledger proves every recorded input file unchanged (in the ranges the plan reads of it) before anything is
written for it, and every run records the digest of those ranges of the files it has no record of before its first
commit.

One rule for every kind of run, since each ends in the one session path: ``resume``, ``run`` continuing an
unfinished run of the same plan, a recipe's stages, MoE upcycling and LoRA extraction alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from resumerge.inputs.contents import (
    Content,
    Hashing,
    Spans,
    check_looks,
    local_input_files,
    prove_unchanged,
    record_contents,
    spans_bytes,
)
from resumerge.inputs.readdigests import Ranges, ReadDigests, hashed_in_reads
from resumerge.inputs.spans import merged_spans
from resumerge.inputs.torch_bin import is_pickle_checkpoint
from resumerge.machine import killpoints
from resumerge.machine.memory import format_size
from resumerge.merge.plan.fetching import read_order
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.plan.workorder import compute_order
from resumerge.merge.store.ledger import Ledger

_TELL_FROM = 1 << 30


class InputContents:
    """Made when the session has opened the run's ledger, before OUT is touched; every check and proof happens here,
    before anything is recorded for the run. A file is proved by the ranges the plan's units read of it
    (:func:`read_ranges`), those of the units committed and of those left alike. Raises
    :class:`~resumerge.errors.PlanChangedError` (exit 4, naming the file) when a local input file no longer looks
    as it did when the plan opened it (``seen``: written while the merge was being planned), or when the ledger
    records this plan and a file no longer holds, in those ranges, the bytes recorded when the run started.
    :meth:`record` hashes and keeps what the ledger lacks once the run is recorded (``open_run``), before its first
    commit: hashing reads what the merge will read (a large first run spends a moment on it, and the page cache it
    fills serves the merge's own reads), and a run killed then is a recorded run that ``resume`` finishes (its
    files trusted by the plan's identity and hashed then, as a run recorded before contents were), where hashing
    them first left a ledger with no run in it, and ``resume`` saying the run died planning."""

    def __init__(self, plan: Plan, ledger: Ledger, records_dir: str | os.PathLike[str] | None, *,
                 seen: Mapping[str, tuple[int, int]], restart: bool, tell: Callable[[str], None] | None = None
                 ) -> None:
        paths = local_input_files(plan.model_dirs, plan.inputs)
        check_looks(paths, seen)
        self._plan = plan
        self._proved: dict[str, Content] = {}
        self._ranges: dict[str, Ranges] = {}
        self._spans: Mapping[str, Spans] = {}
        self._unrecorded: list[Path] = []
        self._records_dir, self._seen = records_dir, seen
        self._hashing: Hashing | None = None
        row = ledger.run_row()
        # Only a continued run's record counts: another plan's says nothing about this one's inputs.
        continuing = row is not None and row.fingerprint == plan.fingerprint
        if row is not None and not continuing and not restart:
            return  # open_run refuses the run (a merge planned differently): nothing to hash for it
        hashing = self._hashing = _telling(tell) if tell is not None else None
        self._ranges = read_ranges(plan, {str(p) for p in paths})
        self._spans = _MergedSpans(self._ranges)
        recorded = {p: Content(*c) for p, c in ledger.input_contents().items()} if continuing else {}
        ours = {str(p) for p in paths}
        self._proved = prove_unchanged({p: c for p, c in recorded.items() if p in ours}, records_dir, hashing,
                                      self._spans, self._ranges)
        # A run recorded before contents were (or by a process killed before recording them: then with no file
        # committed) is trusted by the plan's identity, as it was then, and its files are recorded now.
        self._unrecorded = [p for p in paths if str(p) not in recorded]

    def record(self, ledger: Ledger, notes: list[str]) -> None:
        """Hash and record the content of every file the ledger had no record of (raises
        :class:`~resumerge.errors.PlanChangedError` for one that no longer looks as the plan saw it), and record
        the new look of those proved unchanged (``notes`` says which were)."""
        if self._proved:
            notes.append(touched_note(self._proved, self._spans))
        _write(ledger, self._hashed(self._reads((), ())))

    def record_beside(self, ledger: Ledger, notes: list[str], after: threading.Thread | None = None) -> Proving:
        """:meth:`record` on a thread of its own, for a run whose every commit waits for it (:meth:`Proving.checked`,
        the local inputs' check): the ranges the merge's units read are hashed in their reads
        (:attr:`Proving.reads`, given to the run's sources), and the proof, once ``after`` (torch's import) has
        ended, hashes beside the units those the first shard does not read, from the last read back, then what no
        read has hashed when the first commit asks (:mod:`resumerge.inputs.readdigests`). ``notes`` says at once
        which files were proved unchanged."""
        if self._proved:
            notes.append(touched_note(self._proved, self._spans))
        # The files' looks taken now, before any unit reads: a write while they are read refuses the run. The order
        # of the plan's reads only where a unit hashes a range (a 90k-tensor plan of tiny ones: none; its order took
        # the main thread a second before the first unit, bench/RESULTS.md, many72).
        order: list[tuple[str, str, int, int]] = []
        first: list[tuple[str, str, int, int]] = []
        if hashed_in_reads(self._present()):
            shards = compute_order(self._plan)
            first = [(r.model, r.file, r.start, r.end) for name in (shards[0].tensors if shards else ())
                     for r in self._plan.tensors[name].reads()]
            order = read_order(self._plan, order=shards)
        reads = self._reads(order, first)
        return Proving(lambda: self._hashed(reads), ledger, after, reads)

    def _present(self) -> dict[str, Ranges]:
        """The ranges of each file to record by its ranges: those present, not pickled."""
        return {str(p): self._ranges[str(p)] for p in self._unrecorded if str(p) in self._ranges and p.is_file()}

    def _reads(self, order: Iterable[tuple[str, str, int, int]], first: Iterable[tuple[str, str, int, int]]
               ) -> ReadDigests:
        """The per-range digests of the files to record (those present, not pickled), the proof's order the
        reverse of ``order`` ((model, file, start, end), the plan's reads in the order computed), ``first`` (the
        first shard's reads) left to the units until a commit asks."""
        dirs = self._plan.model_dirs
        present = self._present()
        paths: dict[tuple[str, str], str] = {}  # joined once a file, not once a read (90k tensors)

        def path_of(model: str, file: str) -> str:
            found = paths.get((model, file))
            if found is None:
                found = paths[model, file] = str(Path(dirs[model]) / file) if model in dirs else ""
            return found

        return ReadDigests(present, ((path_of(m, f), start, end) for m, f, start, end in order),
                           ((path_of(m, f), start, end) for m, f, start, end in first))

    def _hashed(self, reads: ReadDigests) -> dict[str, Content]:
        killpoints.reach("before_input_hashing")  # the run is recorded: a kill here is one resume finishes
        return {**record_contents(self._unrecorded, self._records_dir, self._seen, self._hashing, self._spans,
                                  reads),
                **self._proved}


def _write(ledger: Ledger, found: Mapping[str, Content]) -> None:
    if found:
        ledger.record_input_contents({p: (c.size, c.mtime_ns, c.ctime_ns, c.digest) for p, c in found.items()})


class Proving:
    """A run's input proof taken on a thread of its own (:meth:`InputContents.record_beside`): ``hashed()``'s
    digests written to ``ledger`` once taken. A committed shard is always computed from bytes whose digest the ledger
    holds: the writer publishes a shard only once every input file it read is checked, and a local input is checked
    once the proof is recorded (:meth:`checked`, which raises what failed it). :meth:`leave` as the run ends, before
    the ledger closes: a proof still reading then records nothing."""

    def __init__(self, hashed: Callable[[], dict[str, Content]], ledger: Ledger,
                 after: threading.Thread | None = None, reads: ReadDigests | None = None) -> None:
        self.reads = reads  # the ranges the run's reads hash for the proof (InputSources.with_proof)
        self._hashed, self._ledger, self._after = hashed, ledger, after
        self._lock = threading.Lock()
        self._left = False
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._prove, name="resumerge-proof", daemon=True)
        self._thread.start()

    def _prove(self) -> None:
        try:
            if self._after is not None:
                # Beside torch's import the proof's reads slowed both: the two ended later than one after the
                # other, as the first unit waits for the import (bench/RESULTS.md, issue 72, linear72c).
                self._after.join()
            found = self._hashed()
            with self._lock:
                if not self._left:
                    _write(self._ledger, found)
        except BaseException as exc:  # raised by checked(), on the thread that waits for it
            self._error = exc
        finally:
            self._done.set()

    def checked(self, timeout: float) -> bool:
        """Whether the proof is recorded, waiting up to ``timeout`` seconds; raises what failed it. Asked, by a
        commit: what the reads were left to hash is hashed now."""
        if self.reads is not None and not self._done.is_set():
            self.reads.need()
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def leave(self) -> None:
        """The run ends: a proof not written yet is never written (the ledger is about to close)."""
        with self._lock:
            self._left = True
        if self.reads is not None:
            self.reads.stop()  # a proof waiting for a commit, or still hashing, stops


def read_ranges(plan: Plan, local: set[str]) -> dict[str, Ranges]:
    """The distinct byte ranges the plan's units read of each ``local`` file (by path), sorted: what the content
    proof hashes, a digest per range. A file the plan never reads has none; a PyTorch ``.bin`` file, read by
    virtual ranges of its pickled storages, is left out (hashed whole)."""
    reads: dict[str, list[tuple[int, int]]] = {path: [] for path in local}
    by_file: dict[tuple[str, str], list[tuple[int, int]] | None] = {}  # (model, file) -> its path's list
    for tensor in plan.tensors.values():
        for ref in tensor.reads():
            key = (ref.model, ref.file)
            if key not in by_file:
                directory = plan.model_dirs.get(ref.model)
                by_file[key] = None if directory is None else reads.get(str(Path(directory) / ref.file))
            found = by_file[key]
            if found is not None and ref.end > ref.start:
                found.append((ref.start, ref.end))
    return {path: _distinct(ranges) for path, ranges in reads.items() if not is_pickle_checkpoint(path)}


def _distinct(ranges: list[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, each once (a range two tensors read is hashed once: sorting first costs a 90k-tensor plan
    less than a set of them)."""
    ranges.sort()
    return tuple(r for i, r in enumerate(ranges) if not i or r != ranges[i - 1])


class _MergedSpans(Mapping[str, Spans]):
    """Each file's ranges merged into spans (what the records of the span form cover), merged when first asked: a
    first run asks none (its records are per range), a resume only those of files touched."""

    def __init__(self, ranges: Mapping[str, Ranges]) -> None:
        self._ranges = ranges
        self._merged: dict[str, Spans] = {}

    def __getitem__(self, path: str) -> Spans:
        found = self._merged.get(path)
        if found is None:
            found = self._merged[path] = merged_spans(self._ranges[path])
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)


def touched_note(proved: Mapping[str, Content], spans: Mapping[str, Spans] | None = None) -> str:
    """The line saying that the files ``proved`` (paths) were touched but hold the bytes they held in every range the
    run reads of them (``spans``, by path; the whole file where absent): by folder (two models' shards share their
    names), each name once."""
    folders: dict[str, list[str]] = {}
    for path in sorted(proved):
        folders.setdefault(str(Path(path).parent), []).append(Path(path).name)
    listed = "; ".join(f"{folder}: {_names(names)}" for folder, names in folders.items())
    plural = "s" if len(proved) != 1 else ""
    covered = [(spans_bytes(spans[p]) if spans is not None and p in spans else c.size, c.size)
               for p, c in proved.items()]
    read, size = sum(r for r, _ in covered), sum(s for _, s in covered)
    where = "" if read == size else (f" in every range this merge reads ({format_size(read)} of "
                                     f"{format_size(size)}; an edit elsewhere changes nothing it writes)")
    return (f"{len(proved)} input file{plural} touched since the run started (modified, or a time or a mode changed) "
            f"hold the bytes they held then{where}, proved by hashing them again — {listed}")


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
            tell(f"hashing what this merge reads of {files} input file{plural} ({format_size(size)}) so that a resume "
                 "can prove it unchanged")

    return hashing

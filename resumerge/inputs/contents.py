"""The content proof of local input files: a digest of the bytes a run reads of each weight file, recorded before
the run's first commit and checked again whenever a file no longer looks as it did.

A plan identifies a weight file by its size, header and sampled blocks (:func:`~resumerge.inputs.files.
file_identity`): cheap, and enough to tell two models apart, but blind to a tensor re-drawn between two samples.
A resume that trusted it merged the rest of a run from edited bytes into an output whose first shards came from
the old ones. The rule, in one place:

- when a run is recorded, each local weight file's digest is recorded with its size, mtime and ctime: an xxh3-128
  over the xxh3-128 digests of the byte ranges the plan reads of it, in file order (``xxh3-128r:RANGES:HEX``,
  :mod:`resumerge.inputs.readdigests`), so a file a slice reads a third of costs a third, a file it never reads
  costs nothing, and a range is hashed in the read the merge makes of it anyway (the proof hashes only the ranges
  no read has); a pickled ``.bin`` (read by its storages' virtual ranges) has its whole bytes hashed in the span
  form below;
- a resume (or ``run`` continuing a run) trusts a file whose size, mtime and ctime are all as recorded (writing,
  replacing or ``touch``-ing a file moves its ctime, which user space cannot set back); any other file has the same
  ranges hashed again (the ranges both the committed units and the remaining ones read), and a different digest
  refuses the run (:class:`~resumerge.errors.PlanChangedError`, exit 4) naming the file; the same digest (a
  ``touch``, a copy back, an edit outside every range the plan reads) is proof, said in one line, and the new look
  is recorded.

xxh3-128 is not cryptographic: it sees any accidental or ordinary edit (a re-saved tensor, a flipped bit, a
truncated copy: two different contents share a digest with odds of 2^-128), not a collision built on purpose; the
output's own files keep their sha256. A ledger recorded in an older form is proved in the form it holds: an
xxh3-128 over the plan's merged read spans (``xxh3-128:SPANS:HEX``), or a whole-file sha256.

Hashing costs one read of the ranges, so a digest is also kept in the state dir's verification records (beside the
hub's, keyed by the file's real path and the ranges it covers) and reused while the file's size and mtime are
unchanged and it was last written or replaced well before it was hashed: merging the same local models again hashes
nothing. Hub files are not here: their identity is the hub's own checksum, verified against the cache on every run.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import xxhash

from resumerge.errors import PlanChangedError
from resumerge.inputs.files import file_look
from resumerge.inputs.hub.records import VerifyRecords, now_ns
from resumerge.inputs.looks import hash_spans
from resumerge.inputs.readdigests import RANGES, Ranges, ReadDigests, ranges_method
from resumerge.inputs.spans import merged_spans

if TYPE_CHECKING:
    from resumerge.inputs.model import ModelInput

_HUB_SNAPSHOT = re.compile(r"/snapshots/[0-9a-f]{40}$")  # a hub model's recorded folder (see inputs.catalog)
_ALGORITHM = "xxh3-128"
_LEGACY = "sha256"  # a ledger recorded before the per-span rule holds whole-file sha256 digests (64 hex digits)

# Told (files, bytes) before files are hashed: a run says why it reads its inputs once before merging.
Hashing = Callable[[int, int], None]
# The [start, end) byte ranges of a file a plan reads, sorted and merged; None for the whole file.
Spans = Sequence[tuple[int, int]]


class Content(NamedTuple):
    """What a local input file looked like when the bytes the run reads of it hashed to ``digest``
    (``xxh3-128r:RANGES:HEX``, RANGES naming the ranges covered; ``xxh3-128:SPANS:HEX`` or a whole-file sha256 in a
    ledger recorded before)."""

    size: int
    mtime_ns: int
    ctime_ns: int
    digest: str


def local_input_files(model_dirs: Mapping[str, str], inputs: Mapping[str, Iterable[tuple[str, int, str]]]
                      ) -> list[Path]:
    """Every weight file of a plan (``plan.model_dirs``, ``plan.inputs``) that is a local file, in a fixed order:
    a hub model's files are left to the hub's checksums, and a file not on disk (a later stage's input, written by
    an earlier stage of a recipe once that stage runs) to the plan's identity."""
    found: list[Path] = []
    for key, files in sorted(inputs.items()):
        directory = model_dirs.get(key)
        if directory is None or _HUB_SNAPSHOT.search(directory):
            continue
        found.extend(Path(directory) / f[0] for f in files)
    return found


def opened_looks(models: Iterable[ModelInput]) -> dict[str, tuple[int, int]]:
    """How each local weight file of ``models`` (and of their adapters) looked when it was opened for the plan,
    by path: (size, mtime_ns)."""
    found: dict[str, tuple[int, int]] = {}
    for model in models:
        for directory, files in ((model.directory, model.files),
                                 *(((model.adapter.directory, model.adapter.files),) if model.adapter else ())):
            found.update((str(Path(directory) / f.name), f.seen) for f in files if f.seen is not None)
    return found


def check_looks(paths: Iterable[Path], seen: Mapping[str, tuple[int, int]]) -> None:
    """Raise :class:`PlanChangedError` for the first of ``paths`` that no longer looks as ``seen`` (by path) when
    it was opened for the plan: it was written while the merge was being planned."""
    for path in paths:
        before = seen.get(str(path))
        if before is None:
            continue
        try:
            now = file_look(path)
        except FileNotFoundError:
            raise _changed(path, "was deleted while the merge was being planned", planning=True) from None
        if now != before:
            raise _changed(path, "changed while the merge was being planned", planning=True)


def spans_bytes(spans: Spans) -> int:
    """The bytes ``spans`` cover."""
    return sum(end - start for start, end in spans)


def record_contents(paths: Iterable[Path], records_dir: str | os.PathLike[str] | None,
                    seen: Mapping[str, tuple[int, int]] | None = None, hashing: Hashing | None = None,
                    spans: Mapping[str, Spans] | None = None, reads: ReadDigests | None = None
                    ) -> dict[str, Content]:
    """The :class:`Content` of each of ``paths`` present: a file of ``reads`` by the digests of its ranges (those
    the merge's reads took, the rest hashed now), any other by the bytes of its ``spans`` (by path; the whole file
    where absent), unless the state dir's records hold its digest (``hashing`` is told how many files and bytes
    are hashed first); files hashed in parallel, most bytes first. Raises :class:`PlanChangedError` for a file
    written while it was hashed, or that does not look as ``seen`` when it was opened for the plan."""
    present = [p for p in paths if p.is_file()]
    jobs = [(p, _Ranges(p, reads) if reads is not None and str(p) in reads else _Spans(p, _spans_of(p, spans)))
            for p in present]
    with VerifyRecords(records_dir) as records:
        found = _digests(jobs, records, hashing)
    for path, content in zip(present, found):
        before = (seen or {}).get(str(path))
        if before is not None and before != (content.size, content.mtime_ns):
            raise _changed(path, "changed while the merge was being planned", planning=True)
    return {str(path): content for path, content in zip(present, found)}


def prove_unchanged(recorded: Mapping[str, Content], records_dir: str | os.PathLike[str] | None,
                    hashing: Hashing | None = None, spans: Mapping[str, Spans] | None = None,
                    ranges: Mapping[str, Ranges] | None = None) -> dict[str, Content]:
    """Check every file of ``recorded`` against what was recorded when the run started; returns the files that
    look different but hold the same bytes in every range recorded (in the form recorded: ``ranges`` by path for
    an ``xxh3-128r`` digest, none where absent; ``spans`` by path for an ``xxh3-128`` one, the whole file where
    absent; the whole file's sha256 for a digest recorded before either), with how they look now (to record).
    Raises :class:`PlanChangedError`, naming the first file whose bytes differ (or that is gone)."""
    looked_again: list[Path] = []
    for name, before in sorted(recorded.items()):
        path = Path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise _changed(path, "was deleted") from None
        if st.st_size != before.size:
            raise _changed(path, f"is {st.st_size} bytes, {before.size} when the run started")
        if (st.st_mtime_ns, st.st_ctime_ns) != (before.mtime_ns, before.ctime_ns):
            looked_again.append(path)
    if not looked_again:
        return {}
    jobs = [(p, _form_of(recorded[str(p)].digest, p, spans, ranges)) for p in looked_again]
    with VerifyRecords(records_dir) as records:
        now = _digests(jobs, records, hashing)
    for path, content in zip(looked_again, now):
        if content.digest != recorded[str(path)].digest:
            raise _changed(path, "holds other bytes than when the run started (same size, modified since)")
    return {str(path): content for path, content in zip(looked_again, now)}


def _form_of(digest: str, path: Path, spans: Mapping[str, Spans] | None, ranges: Mapping[str, Ranges] | None
             ) -> _Form:
    """How ``digest`` (as recorded for ``path``) is taken again."""
    if _is_legacy(digest):
        return _Whole(path)
    if digest.startswith(RANGES + ":"):
        return _Ranges(path, ReadDigests({str(path): tuple((ranges or {}).get(str(path), ()))}))
    return _Spans(path, _spans_of(path, spans))


def _spans_of(path: Path, spans: Mapping[str, Spans] | None) -> tuple[tuple[int, int], ...]:
    """The spans of ``path`` to hash: as given, else the whole file."""
    given = (spans or {}).get(str(path))
    return tuple(given) if given is not None else ((0, os.stat(path).st_size),)


def _is_legacy(digest: str) -> bool:
    return len(digest) == 64 and ":" not in digest


class _Form(Protocol):
    """How a file's recorded digest is taken: its records' name, the bytes left to hash, and the hash itself;
    iterated, the [start, end) spans of the file it covers, merged, in file order."""

    def __iter__(self) -> Iterator[tuple[int, int]]: ...

    def method(self) -> str: ...

    def cost(self) -> int: ...

    def settled(self) -> None:
        """The records vouch for the file: nothing of it is hashed."""

    def take(self) -> tuple[Content, int]:
        """The file's content and when its hash started (ns, for the records); raises :class:`PlanChangedError`
        when it changed while it was read."""


class _InTake:
    """A form hashed all in :meth:`take`, nothing of it ahead (as the merge's reads hash a range form's ranges): the
    records vouching for the file leave nothing to stop."""

    def settled(self) -> None:
        """Nothing to stop: no hash of the file runs ahead of :meth:`take`."""


class _Whole(_InTake):
    """The whole file's sha256: what a ledger recorded before spans were."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Iterator[tuple[int, int]]:
        yield 0, self.path.stat().st_size

    def method(self) -> str:
        return _LEGACY

    def cost(self) -> int:
        return self.path.stat().st_size

    def take(self) -> tuple[Content, int]:
        path = self.path
        started = now_ns()
        digest = hashlib.sha256()
        whole = ((0, os.stat(path).st_size),)
        (size, mtime, ctime, _), racy = hash_spans(path, [(whole, digest)], lambda: _read_changed(path))
        if size != whole[0][1]:  # grown or cut between the size read and the hash
            raise _read_changed(path)
        # Written within a timestamp tick of the hash: the look recorded never matches, a resume hashes it again.
        return Content(size, mtime, -1 if racy else ctime, digest.hexdigest()), started


class _Spans(_InTake):
    """The xxh3-128 of a file's merged spans read in order (``xxh3-128:SPANS:HEX``): the form before per-range
    digests, still the one of a pickled ``.bin`` (read by its storages' virtual ranges, hashed whole)."""

    def __init__(self, path: Path, spans: tuple[tuple[int, int], ...]) -> None:
        self.path, self.spans = path, spans

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.spans)

    def method(self) -> str:
        return f"{_ALGORITHM}:{xxhash.xxh3_64_hexdigest(repr(self.spans).encode())}"

    def cost(self) -> int:
        return spans_bytes(self.spans)

    def take(self) -> tuple[Content, int]:
        path = self.path
        started = now_ns()
        digest = xxhash.xxh3_128()
        (size, mtime, ctime, _), racy = hash_spans(path, [(self.spans, digest)], lambda: _read_changed(path))
        return Content(size, mtime, -1 if racy else ctime, f"{self.method()}:{digest.hexdigest()}"), started


class _Ranges:
    """The xxh3-128 of a file's per-range xxh3-128 digests in file order (``xxh3-128r:RANGES:HEX``,
    :mod:`resumerge.inputs.readdigests`): the ranges the merge's reads hashed are taken as they were, the rest
    hashed here."""

    def __init__(self, path: Path, reads: ReadDigests) -> None:
        self.path, self.reads = path, reads
        self._method = ""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(merged_spans(self.reads.ranges(str(self.path))))

    def method(self) -> str:
        if not self._method:  # named once: the name of a 90k-tensor file's ranges takes milliseconds
            self._method = ranges_method(self.reads.ranges(str(self.path)))
        return self._method

    def cost(self) -> int:
        return self.reads.left(str(self.path))

    def settled(self) -> None:
        self.reads.settled(str(self.path))  # the merge's reads stop hashing it

    def take(self) -> tuple[Content, int]:
        path = self.path
        self.reads.hash_ahead(_read_changed)  # every file's ranges read late, then the wait for the first commit
        self.reads.hash_rest(path, _read_changed)
        (size, mtime, ctime, _), started, digest = self.reads.digest(path, lambda: _read_changed(path))
        return Content(size, mtime, ctime, f"{self.method()}:{digest}"), started


def _digests(jobs: Sequence[tuple[Path, _Form]], records: VerifyRecords, told: Hashing | None) -> list[Content]:
    """The content of each file of ``jobs`` (path, how its digest is taken), in their order: from ``records``
    when trusted, else hashed."""
    found: dict[Path, Content] = {}
    hashing = []
    for path, form in jobs:
        known = _known(path, form.method(), records)
        if known is not None:
            found[path] = known
            form.settled()
        else:
            hashing.append((path, form))
    if hashing:
        costs = {path: form.cost() for path, form in hashing}
        hashing.sort(key=lambda job: -costs[job[0]])  # one large file started last would leave the others idle
        if told is not None:
            told(len(hashing), sum(costs.values()))
        workers = min(len(hashing), os.cpu_count() or 1, 8)
        with ThreadPoolExecutor(workers, thread_name_prefix="resumerge-contents") as pool:
            for (path, _), (content, started) in zip(hashing, pool.map(_hash, hashing)):
                found[path] = content
                method, _, digest = content.digest.rpartition(":")
                records.record(path.resolve(), method or _LEGACY, digest, started)
    return [found[path] for path, _ in jobs]


def _known(path: Path, method: str, records: VerifyRecords) -> Content | None:
    """The recorded digest of ``path`` when the records can vouch for it: same size and mtime as when hashed, and
    neither written nor replaced (its ctime) since shortly before."""
    st = os.stat(path)
    digest = records.digest_of(path.resolve(), method, newer_than=max(st.st_mtime_ns, st.st_ctime_ns))
    if digest is None:
        return None
    return Content(st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest if method == _LEGACY else f"{method}:{digest}")


def _hash(job: tuple[Path, _Form]) -> tuple[Content, int]:
    """Take the digest of ``job``'s file in its form: its content and when the hash started (for the records)."""
    return job[1].take()


def _read_changed(path: Path) -> PlanChangedError:
    return _changed(path, "changed while it was being read")


def _changed(path: Path, what: str, *, planning: bool = False) -> PlanChangedError:
    if planning:
        return PlanChangedError(f"input file {path} {what}; nothing was merged from it", path=str(path),
                                hint="run the same command again once the file is final")
    return PlanChangedError(
        f"input file {path} {what}; the merge's committed shards were made from the bytes it held then",
        path=str(path),
        hint="restore the file as it was and resume, or start over with resumerge run CONFIG OUT --restart",
    )

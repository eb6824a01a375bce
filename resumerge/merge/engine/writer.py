"""The writer thread of the executor's pipeline (:mod:`resumerge.merge.engine.executor`): it takes a run's finished
tensors in shard order, streams each shard to its temp file and hashes it (:class:`~resumerge.merge.store.shardwriter.
ShardWriter`), and once a shard's last tensor is in and every input file it read is checked, publishes it through
the sink and records it in the :class:`Journal`; a stop deletes the unfinished shard's temp file. A file planned
in units whose sink writes in place (a GGUF output in a local OUT) is written by a :class:`~resumerge.merge.store.
unitwriter.UnitFileWriter` instead, each unit journaled through the :class:`UnitJournal` once durable; a stop keeps
it, with the units journaled. Files one computation writes together (a GGUF release's: ``members``) are written as
a :class:`FileGroup`, each tensor's parts to the file that holds them, each file committed on its own.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from resumerge.errors import ResumergeError
from resumerge.inputs.source import InputSources
from resumerge.machine.checksums import Checksum
from resumerge.machine.memory import Reservation
from resumerge.merge.engine import cpupriority
from resumerge.merge.engine.bufferpool import BufferPool
from resumerge.merge.engine.compute import Stored
from resumerge.merge.engine.reporting import Reporter
from resumerge.merge.plan.fetching import shard_input_files
from resumerge.merge.plan.merge_plan import Plan, ShardPlan
from resumerge.merge.store.shardwriter import ShardWriter
from resumerge.merge.store.sink import OutputSink, Receipt
from resumerge.merge.store.units import Unit
from resumerge.merge.store.unitwriter import UnitFileWriter


class Journal(Protocol):
    """Where the writer records each finished shard: the run's :class:`~resumerge.merge.store.journal_commit.
    CommitJournal`, or what a cluster worker hands back to the driver that journals it
    (:mod:`resumerge.merge.engine.cluster`). Its :attr:`checksum` is what the writer hashes every file and unit with."""

    @property
    def checksum(self) -> Checksum: ...

    def record(self, receipt: Receipt, size: int, sha256: str, *, seconds: float = 0.0,
               tensors: tuple[str, ...] = (), manifest_point: bool = True) -> None: ...

    def settle(self, *, strict: bool = True) -> None: ...


class UnitJournal(Protocol):
    """Where the writer journals each unit of a file written in place (the run's :class:`~resumerge.merge.store.ledger.
    Ledger`)."""

    def commit_unit(self, name: str, index: int, sha256: str) -> None: ...


@dataclass(frozen=True)
class InPlace:
    """The files a run writes in place, unit by unit: each unit journaled in ``units`` once durable; ``kept``, for
    each such file still pending, the units a previous run wrote and this one keeps
    (:func:`~resumerge.merge.engine.executor.kept_units`): their tensors are not computed again."""

    units: UnitJournal
    kept: Mapping[str, frozenset[int]]


# (shard, names, their tensors or rows, the reservation that holds them all): one unit's, a group's or a chunk's.
Item = tuple[ShardPlan, tuple[str, ...], list[Stored], "Reservation | None"]
FileWriter = ShardWriter | UnitFileWriter


class FileGroup:
    """The files one computation writes together (a GGUF release's), each by its own writer: a tensor's stored
    parts go to the file that holds them, to each file that still needs the tensor (one that kept the unit holding
    it from a previous run is not written again)."""

    def __init__(self, files: Sequence[tuple[ShardPlan, FileWriter, Mapping[str, tuple[str, ...]]]]) -> None:
        """``files``: each file's plan, writer and its stored parts of each tensor."""
        self.files = list(files)

    @property
    def expected_name(self) -> str | None:
        """The tensor some file needs next, or None when every file is written."""
        return next((name for _, w, _ in self.files if (name := w.expected_name) is not None), None)

    def write(self, name: str, tensor: Stored) -> bool:
        """Each file's parts of ``tensor`` (whole or its next rows) written to every file whose next tensor it is;
        True once all its bytes are written."""
        took = [w.write(name, {p: tensor[p] for p in parts[name]}) for _, w, parts in self.files
                if w.expected_name == name]
        if not took:
            raise ResumergeError(f"internal: no file of {self.files[0][0].name} expected {name}")
        return all(took)

    def finish(self) -> Iterator[tuple[ShardPlan, tuple[int, str, Receipt]]]:
        """Each file hashed and published, in order, each as it is asked for: the caller records one before the
        next is published (a kill between two keeps the first committed)."""
        while self.files:
            shard, w, _ = self.files[0]
            found = w.finish()
            del self.files[0]  # published: never aborted after
            yield shard, found

    def abort(self) -> None:
        for _, w, _ in self.files:
            w.abort()


class Writer(threading.Thread):
    """Consumes items of one shard's tensors in its order; commits each shard after its last tensor."""

    def __init__(self, plan: Plan, sink: OutputSink, journal: Journal, reporter: Reporter,
                 sources: InputSources | None = None, yield_cpu: bool = False, *, in_place: InPlace | None = None,
                 pool: BufferPool | None = None, members: Mapping[str, Sequence[ShardPlan]] | None = None) -> None:
        """``in_place``: the files written in place and the units of each a previous run wrote; a file not kept
        there is written whole. ``pool``: where the buffers of the tensors
        written go back (those the workers passed on to the writer). ``members``: for a file whose computation
        writes others too (:meth:`~resumerge.outputs.containers.OutputContainer.lead`), the files not committed yet
        that it writes, itself among them unless committed; a file not there writes itself."""
        super().__init__(name="resumerge-writer", daemon=True)
        self.plan, self.sink, self.journal, self.reporter = plan, sink, journal, reporter
        self.sources = sources
        self.yield_cpu = yield_cpu  # lower this thread's priority: the run's transfers go first (cpupriority)
        self.items: queue.Queue[Item | None] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.leaving = threading.Event()  # the run stops: a wait for input checks ends
        self.units = in_place.units if in_place is not None else None
        self.kept = dict(in_place.kept) if in_place is not None else {}
        self.pool = pool
        self.members = dict(members or {})
        self._current: FileGroup | None = None
        self._shard_since = 0.0  # when the current shard started

    def run(self) -> None:
        if self.yield_cpu:
            cpupriority.yield_to_transfers()
        try:
            while True:
                try:
                    item = self.items.get(timeout=0.5)
                except queue.Empty:
                    self.journal.settle()  # commits that finished while computation ran
                    continue
                if item is None:
                    return
                shard, names, tensors, reservation = item
                del item
                try:
                    if not self._write(shard, names, tensors):
                        return
                finally:
                    self._give_back(tensors)
                    tensors.clear()  # freed (or idle in the pool) before their reservation is returned
                    if reservation is not None:
                        reservation.release()
        except BaseException as exc:
            self.error = exc
            self.abort()
            self.drain()

    def _write(self, shard: ShardPlan, names: tuple[str, ...], tensors: list[Stored]) -> bool:
        """Write the tensors (or rows) ``names`` of ``shard``, committing it after its last; False when the run
        stopped first (the unfinished shard's temp file is deleted)."""
        if not names:  # a file written in place whose every unit is kept: only its commit is left
            self._open(shard)
            return self._commit(shard)
        for name, tensor in zip(names, tensors, strict=True):
            current = self._current or self._open(shard)  # asked at each tensor only while none is open
            if not current.write(name, tensor):
                continue
            self.reporter.tensor_done(name, self.plan.tensors[name].nbytes)
            if current.expected_name is None and not self._commit(shard):
                return False
        return True

    def _open(self, shard: ShardPlan) -> FileGroup:
        """The writers of ``shard`` and the files written with it, made at its first tensor."""
        if self._current is None:
            self._current = FileGroup([])
            for member in self.members.get(shard.name, (shard,)):  # each made in turn: all aborted on a failure
                self._current.files.append((member, self._file(member), self.plan.shard_parts(member)))
            self._shard_since = time.monotonic()
        return self._current

    def _file(self, shard: ShardPlan) -> FileWriter:
        """The writer of one file: in place, unit by unit, when its units are journaled (:attr:`kept` names it),
        else streamed whole to a temp file."""
        layout, parts = self.plan.shard_layout(shard), self.plan.shard_parts(shard)
        kept = self.kept.get(shard.name)
        self.reporter.shard_started(shard.name, shard.file_size, len(shard.tensors))
        if kept is not None and self.units is not None:
            units = [Unit(i, start, end, names) for i, (start, end, names) in enumerate(self.plan.file_units(shard))]
            journal, name = self.units, shard.name
            return UnitFileWriter(self.sink, name, layout, parts, units, kept,
                                  lambda index, sha: journal.commit_unit(name, index, sha),
                                  checksum=self.journal.checksum)
        return ShardWriter(self.sink, shard.name, layout, parts, checksum=self.journal.checksum)

    def _commit(self, shard: ShardPlan) -> bool:
        """Finish the shard just completed (and the files written with it) and record each; False when the run
        stopped first (the temp files not committed are deleted)."""
        assert self._current is not None
        if self.sink.commits_later and self.sources is not None:
            for member, _, _ in self._current.files:
                self.sink.commit_when(member.name, self._checked_now(shard))  # upload now, commit after
        elif not self._inputs_checked(shard):
            self.abort()
            return False
        for member, (size, sha, receipt) in self._current.finish():
            # every tensor is in it (a file written in place: some kept)
            self.journal.record(receipt, size, sha, seconds=time.monotonic() - self._shard_since,
                                tensors=member.tensors)
            self.reporter.file_done(member.name, "shard")
        self._current = None
        return True

    def _inputs_checked(self, shard: ShardPlan) -> bool:
        """Wait until every input file ``shard`` read from is checked against its checksum (a hub download still
        landing is checked at its end), so that nothing computed from unchecked bytes is ever committed; False
        when the run stops first. Raises the error that failed a check."""
        if self.sources is None:
            return True
        for model, file in shard_input_files(self.plan, shard):
            while not self.sources.checked(model, file, 0.2):
                if self.leaving.is_set():
                    return False
        return True

    def _checked_now(self, shard: ShardPlan) -> Callable[[], bool]:
        """Whether every input file ``shard`` read from is checked, without waiting (a sink that commits later asks
        before committing it)."""
        files, sources = shard_input_files(self.plan, shard), self.sources
        assert sources is not None
        return lambda: all(sources.checked(model, file, 0) for model, file in files)

    def drain(self) -> None:
        """Drop queued items (releasing their reservations) until the end marker or a quiet queue."""
        while True:
            try:
                item = self.items.get(timeout=0.2)
            except queue.Empty:
                return
            if item is None:
                return
            self._give_back(item[2])
            item[2].clear()
            if item[3] is not None:
                item[3].release()

    def _give_back(self, tensors: list[Stored]) -> None:
        """The buffers of ``tensors`` (written, or dropped) back to the pool: every write of them has returned (the
        shard writer writes and hashes before it returns)."""
        if self.pool is not None:
            self.pool.give_back(t for stored in tensors for t in stored.values())

    def abort(self) -> None:
        """Delete the unfinished shard's temp file (a file written in place is kept, with its units journaled)."""
        if self._current is not None:
            self._current.abort()
            self._current = None

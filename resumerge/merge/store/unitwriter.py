"""Write one planned file in place, unit by unit, journaling each unit once it is durable (:mod:`.units`).

The writer's side of a GGUF output: the file resumerge creates at :meth:`~resumerge.merge.store.sink.OutputSink.
partial_for` with its planned size, its header written and journaled as unit 0, then each group of tensors written
at its planned offsets (the padding between them as zeros), fsynced, hashed from the file and journaled through
``on_unit``; the units a resume kept (re-hashed by :func:`resumerge.merge.engine.reconcile.reconcile`) are never written
again. Once every unit is in, :meth:`UnitFileWriter.finish` hashes the whole file (the units read back in order as
they were written, the rest at the end), checks the header and size, and publishes it under its final name like
any shard (:class:`~resumerge.merge.store.shardwriter.ShardWriter`, whose interface this shares).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Mapping, Sequence

from resumerge.errors import ResumergeError
from resumerge.inputs.safetensors_format import ShardLayout
from resumerge.inputs.tensorio import TORCH_DTYPES, tensor_bytes
from resumerge.machine import killpoints
from resumerge.machine.checksums import Checksum
from resumerge.machine.durable import fsync_dir, start_writeback, storage_error, sync_file
from resumerge.machine.torch_import import torch
from resumerge.merge.store.shardwriter import close_as_planned, hasher, pwrite_all
from resumerge.merge.store.sink import OutputSink, Receipt
from resumerge.merge.store.units import Unit, hash_range

# Bytes written between two starts of their write-out to disk, as a shard writer does (durable.start_writeback).
_WRITEBACK_BYTES = 32 << 20


class UnitFileWriter:
    """Writes the tensors of the units of ``name`` not in ``kept``, in the file's order, each stored part at its
    planned place; ``on_unit(index, checksum)`` journals a unit once its bytes are durable (the ledger's
    :meth:`~resumerge.merge.store.ledger.Ledger.commit_unit`). Tensors come whole or as row chunks, as to a shard
    writer. ``checksum``: what the units and the file are recorded with.
    """

    def __init__(self, sink: OutputSink, name: str, layout: ShardLayout, parts: Mapping[str, tuple[str, ...]],
                 units: Sequence[Unit], kept: Collection[int], on_unit: Callable[[int, str], None], *,
                 checksum: Checksum) -> None:
        self.sink, self.name, self.layout = sink, name, layout
        self.final = sink.where(name)
        self.path = sink.partial_for(name)
        self._on_unit = on_unit
        self._parts = dict(parts)
        self._planned = {t.name: t for t in layout.order}
        self._pending = [u for u in units if u.index not in kept]
        self._order = [n for u in self._pending for n in u.tensors]
        self._next = 0
        self._written = 0  # tensors written by this writer (the kill point after its first)
        self._done = dict.fromkeys(self._planned, 0)  # bytes written of each stored part, from its start
        self.checksum = checksum
        self._digest = checksum.new()  # the whole file's, fed in file order up to _frontier
        self._frontier = 0
        self._unsent = 0  # bytes written since the disk was last asked to start writing them
        self._fd = -1
        try:
            self._open()
            if self._pending and not self._pending[0].tensors:  # the header: fixed by the plan
                pwrite_all(self._fd, memoryview(layout.header), 0)
                self._commit(self._pending.pop(0))
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc

    def _open(self) -> None:
        """Open the in-place file, creating it (ours from then on) at its planned size when it is not there."""
        try:
            self._fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fsync_dir(self.path.parent)
        if os.fstat(self._fd).st_size != self.layout.file_size:
            os.ftruncate(self._fd, self.layout.file_size)  # zeros: what the padding holds

    @property
    def expected_name(self) -> str | None:
        """The tensor the writer needs next, or None when every unit is written."""
        return self._order[self._next] if self._next < len(self._order) else None

    def write(self, name: str, parts: Mapping[str, torch.Tensor]) -> bool:
        """Write ``parts`` — every stored part of output tensor ``name``, whole or its next rows — each at its
        planned place; journal the unit it completes. Returns True once all the tensor's bytes are written."""
        if self.expected_name != name:
            raise ResumergeError(f"internal: {self.final.name} expected {self.expected_name}, got {name}")
        if set(parts) != set(self._parts[name]):
            raise ResumergeError(f"internal: {name} came as {sorted(parts)}, planned {sorted(self._parts[name])}")
        data_start = len(self.layout.header)
        try:
            for stored, tensor in parts.items():
                planned = self._planned[stored]
                shape = tuple(tensor.shape)
                if tensor.dtype != TORCH_DTYPES[planned.dtype] or shape[1:] != planned.shape[1:]:
                    raise ResumergeError(f"internal: {stored} is {tensor.dtype} {shape}, planned {planned.dtype} "
                                         f"{planned.shape}")
                data = tensor_bytes(tensor.contiguous())
                if self._done[stored] + len(data) > planned.nbytes:
                    raise ResumergeError(f"internal: {stored} got more bytes than planned")
                pwrite_all(self._fd, data, data_start + planned.offset + self._done[stored])
                self._done[stored] += len(data)
                self._unsent += len(data)
            if self._unsent >= _WRITEBACK_BYTES:
                start_writeback(self._fd)  # the disk writes while the next tensors merge, not all at the unit's fsync
                self._unsent = 0
            if any(self._done[p] < self._planned[p].nbytes for p in self._parts[name]):
                return False
            self._next += 1
            self._written += 1
            if self._written == 1:
                killpoints.reach("mid_shard_write")
            unit = self._pending[0]
            if name == unit.tensors[-1]:
                self._fill_gaps(unit)
                self._commit(self._pending.pop(0))
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc
        return True

    def _fill_gaps(self, unit: Unit) -> None:
        """Write zeros where ``unit`` holds no tensor byte (the padding after each tensor): the file's bytes there
        are the planned ones whatever an earlier run left."""
        data_start = len(self.layout.header)
        spans = sorted((data_start + self._planned[p].offset, self._planned[p].nbytes)
                       for n in unit.tensors for p in self._parts[n])
        at = unit.start
        for start, size in [*spans, (unit.end, 0)]:
            if start > at:
                pwrite_all(self._fd, memoryview(bytes(start - at)), at)
            at = max(at, start + size)

    def _commit(self, unit: Unit) -> None:
        """Make ``unit``'s bytes durable, hash them from the file and journal them."""
        killpoints.reach("after_unit_write")
        sync_file(self._fd)
        killpoints.reach("after_unit_fsync")
        in_order = unit.start == self._frontier  # the whole file's hash, fed on the hashing thread meanwhile
        try:
            sha = hash_range(self._fd, unit.start, unit.end, self.checksum,
                             self._digest.update if in_order else None, hasher())
        except EOFError as exc:  # cut short by another process since it was made
            raise self._cut_short(exc) from None
        if in_order:
            self._frontier = unit.end
        self._on_unit(unit.index, sha)
        killpoints.reach("after_unit_commit")

    def finish(self) -> tuple[int, str, Receipt]:
        """Hash the whole file, check its header and size, and publish it under its final name (a rename beside
        it). Returns (size, the checksum's record, receipt), as :meth:`ShardWriter.finish` does."""
        if self._pending:
            raise ResumergeError(f"internal: {self.final.name} finished with units missing")
        try:
            killpoints.reach("after_temp_write")
            hash_range(self._fd, self._frontier, self.layout.file_size, self.checksum,
                       self._digest.update)  # the units kept
            fd, self._fd = self._fd, -1
            close_as_planned(fd, self.layout, self.final)
            recorded = self.checksum.record(self._digest.hexdigest())
            receipt = self.sink.publish(self.path, self.name, recorded)
        except (OSError, EOFError) as exc:
            self.abort()
            if isinstance(exc, EOFError):
                raise self._cut_short(exc) from None
            raise storage_error(exc, self.final) from exc
        return self.layout.file_size, recorded, receipt

    def _cut_short(self, exc: EOFError) -> ResumergeError:
        """The error of a file another process cut short while this one wrote it."""
        return ResumergeError(f"{self.path} was cut short while it was written ({exc})",
                              hint="resume: the units it lost are written again")

    def abort(self) -> None:
        """Close the file, keeping it: the units journaled in it are kept by the next run (never raises)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

"""Stream one planned shard to disk and publish it durably.

The header is known before the first tensor (the plan fixes every dtype and shape), so tensors are written
straight to a temp file in data order — no shard is ever assembled in RAM, and two output tensors never share
a buffer (the "Some tensors share memory" failure cannot happen). :meth:`ShardWriter.finish` runs the commit
protocol up to the sink's publish; the caller journals the file from the receipt
(:class:`~resumerge.merge.store.journal_commit.CommitJournal`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from resumerge.errors import ResumergeError
from resumerge.inputs.safetensors_format import ShardLayout
from resumerge.inputs.tensorio import TORCH_DTYPES, tensor_bytes
from resumerge.machine import killpoints
from resumerge.machine.checksums import Checksum
from resumerge.machine.durable import discard, start_writeback, storage_error, sync_file
from resumerge.machine.torch_import import torch
from resumerge.merge.store.sink import OutputSink, Receipt

_PARALLEL_HASH_BYTES = 1 << 20
# Bytes read back at a time to hash a part written ahead of the hash's frontier (from the page cache).
_REREAD_BYTES = 8 << 20
# Bytes written between two starts of their write-out to disk (see durable.start_writeback).
_WRITEBACK_BYTES = 32 << 20
_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def hasher() -> ThreadPoolExecutor:
    """The process's one hashing thread (shards are written one at a time, by one writer thread)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resumerge-hash")
        return _HASHER


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (pwrite may write less than it was given)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def close_as_planned(fd: int, layout: ShardLayout, final: Path) -> None:
    """fsync and close ``fd`` (closed whatever happens), then hold what is on disk to the planned header and size:
    the header's bytes are compared, not parsed again (the layout that made them is valid; parsing a header of
    thousands of tensors per shard cost more than writing them). The check of every file a writer finishes."""
    try:
        sync_file(fd)
        size = os.fstat(fd).st_size
        header = os.pread(fd, len(layout.header), 0)
    finally:
        os.close(fd)
    killpoints.reach("after_fsync")
    if header != layout.header:
        raise ResumergeError(f"internal: {final.name}'s header is not the planned one")
    if size != layout.file_size:
        raise ResumergeError(f"internal: {final.name} is {size} bytes, planned {layout.file_size}")


def start_hashing() -> None:
    """Start the process's hashing thread now, if it is not running, from the calling thread.

    A thread starts with its creator's scheduling priority (Linux) and keeps it for the process's life: started by
    a writer that yields the CPU to a run's transfers (:mod:`resumerge.merge.engine.cpupriority`), it would hash every
    later run's shards at that lower priority too, the local runs of a notebook included. The engine calls this
    from the run's own thread before any of its threads lowers its priority.
    """
    hasher().submit(int).result()  # the pool's one thread starts at its first task


class ShardWriter:
    """Writes the tensors of one shard, each stored part at its planned offset, to the temp file its output sink
    hands out, and publishes it through the sink (beside the final file on a local disk; staged and copied for
    Drive and other mounts).

    Output tensors come in the shard's order, each (or each row chunk of it) as all its stored parts at once; a
    tensor stored as several parts (a quantized format's codes and scales) has them at different places of the
    layout (it is sorted by dtype, then name), so each part is written where it goes. The checksum (the run's
    algorithm: :mod:`resumerge.machine.checksums`) follows a frontier through the file: bytes written at the
    frontier are hashed as they are written, and bytes written ahead of it are read back (from the page cache)
    when the frontier reaches them. A plain shard is written in file order, entirely at the frontier, as before.
    """

    def __init__(self, sink: OutputSink, name: str, layout: ShardLayout,
                 parts: Mapping[str, tuple[str, ...]] | None = None, *, checksum: Checksum) -> None:
        """``parts``: the stored parts of each output tensor (the layout's names), by output tensor, in the order
        the tensors come; None when every tensor is stored as itself, in layout order. ``checksum``: what the file
        is recorded with."""
        self.sink, self.name = sink, name
        self.final = sink.where(name)
        self.layout = layout
        self.temp = sink.temp_for(name)
        self._parts = dict(parts) if parts is not None else {t.name: (t.name,) for t in layout.order}
        self._order = list(self._parts)
        self._planned = {t.name: t for t in layout.order}
        self._next = 0
        self.checksum = checksum
        self._digest = checksum.new()
        self._data_start = len(layout.header)
        self._frontier = 0  # the file's bytes before it are written and hashed
        self._at = 0  # the index in layout.order of the part the frontier is in
        self._done = dict.fromkeys(self._planned, 0)  # bytes written of each stored part, from its start
        self._reread: memoryview | None = None  # made at the first read-back
        self._unsent = 0  # bytes written since the disk was last asked to start writing them
        try:
            self._fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            if layout.file_size > len(layout.header) + layout.data_bytes:
                os.ftruncate(self._fd, layout.file_size)  # a padded layout (GGUF): the gaps and the tail are zeros
            self._write(memoryview(layout.header), 0)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc

    @property
    def expected_name(self) -> str | None:
        """The tensor the writer needs next, or None when the shard is complete."""
        return self._order[self._next] if self._next < len(self._order) else None

    def write(self, name: str, parts: Mapping[str, torch.Tensor]) -> bool:
        """Write ``parts`` — every stored part of output tensor ``name`` (by stored name), whole or its next rows —
        each at its planned place.

        Returns True once all the tensor's bytes are written, False after a partial write. Raises if ``name``
        is not the planned next tensor, a part is missing or not planned, or a dtype, shape or size disagrees with
        the plan.
        """
        expected = self.expected_name
        if expected is None or expected != name:
            raise ResumergeError(f"internal: {self.final.name} expected {expected}, got {name}")
        if set(parts) != set(self._parts[name]):
            raise ResumergeError(f"internal: {name} came as {sorted(parts)}, planned {sorted(self._parts[name])}")
        pieces = []
        for stored, tensor in parts.items():
            planned = self._planned[stored]
            shape = tuple(tensor.shape)
            whole = self._done[stored] == 0 and shape == planned.shape
            if tensor.dtype != TORCH_DTYPES[planned.dtype] or not (whole or shape[1:] == planned.shape[1:]):
                raise ResumergeError(
                    f"internal: {stored} is {tensor.dtype} {shape}, planned {planned.dtype} {planned.shape}"
                )
            data = tensor_bytes(tensor.contiguous())
            if self._done[stored] + len(data) > planned.nbytes:
                raise ResumergeError(f"internal: {stored} got more bytes than planned")
            pieces.append((self._data_start + planned.offset + self._done[stored], stored, data))
        try:
            for offset, stored, data in sorted(pieces, key=lambda p: p[0]):
                self._write(data, offset)
                self._done[stored] += len(data)
                self._unsent += len(data)
            self._catch_up()
            if self._unsent >= _WRITEBACK_BYTES:
                start_writeback(self._fd)  # the disk writes while the next tensors are merged, not all at finish
                self._unsent = 0
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc
        if any(self._done[p] < self._planned[p].nbytes for p in self._parts[name]):
            return False
        self._next += 1
        if self._next == 1:
            killpoints.reach("mid_shard_write")
        return True

    def _write(self, data: memoryview, offset: int) -> None:
        """Write ``data`` at file offset ``offset``, hashing it on the way when it lies at the frontier."""
        if offset != self._frontier:
            pwrite_all(self._fd, data, offset)
            return
        # Hash on a helper thread while this one writes: both release the GIL (a hub's sha256 alone costs more CPU
        # than the write). Waiting before returning keeps the hash in file order and ``data`` alive while it is read.
        hashed = hasher().submit(self._digest.update, data) if len(data) >= _PARALLEL_HASH_BYTES else None
        if hashed is None:
            self._digest.update(data)
        try:
            pwrite_all(self._fd, data, offset)
        finally:
            if hashed is not None:
                hashed.result()
        self._frontier += len(data)

    def _catch_up(self) -> None:
        """Move the frontier over every byte written ahead of it that it now reaches, hashing them as read back."""
        order = self.layout.order
        while self._at < len(order):
            part = order[self._at]
            start = self._data_start + part.offset
            self._reread_to(start + self._done[part.name])
            if self._done[part.name] < part.nbytes:
                return
            self._at += 1

    def _reread_to(self, written: int) -> None:
        """Hash the file's bytes from the frontier to ``written``, read back."""
        while self._frontier < written:
            # Read back into the writer's one buffer: a fresh bytes object per read made the kernel zero new
            # pages for every chunk (a quantized shard, written mostly ahead of its frontier, is read back whole).
            if self._reread is None:
                self._reread = memoryview(bytearray(_REREAD_BYTES))
            want = self._reread[:min(_REREAD_BYTES, written - self._frontier)]
            got = os.preadv(self._fd, [want], self._frontier)
            if not got:
                raise OSError(errno.EIO, f"{self.temp} is shorter than what was written to it")
            self._digest.update(want[:got])
            self._frontier += got

    def finish(self) -> tuple[int, str, Receipt]:
        """fsync, verify the header and size, and publish through the sink (local: rename, fsync the directory;
        staged: copy, read back, verify, rename).

        Returns (size, the checksum's record, receipt). When the receipt is settled already the file is durable
        under its final name; only the ledger row is missing, and resume deletes a final-named file that has none.
        Otherwise the sink commits it later (see :meth:`~resumerge.merge.store.sink.OutputSink.publish`).
        """
        if self._next != len(self._order):
            raise ResumergeError(f"internal: shard {self.final.name} finished with tensors missing")
        try:
            self._reread_to(self.layout.file_size)  # a padded layout's tail of zeros (none for safetensors)
            killpoints.reach("after_temp_write")
            if self._frontier != self.layout.file_size:
                raise ResumergeError(f"internal: {self.final.name} is {self._frontier} bytes, planned "
                                     f"{self.layout.file_size}")
            fd, self._fd = self._fd, -1
            close_as_planned(fd, self.layout, self.final)
            recorded = self.checksum.record(self._digest.hexdigest())
            receipt = self.sink.publish(self.temp, self.name, recorded)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc
        return self.layout.file_size, recorded, receipt

    def abort(self) -> None:
        """Close and delete the temp file (safe to call more than once; never raises, so the error being
        handled is the one reported)."""
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            with contextlib.suppress(OSError):
                os.close(fd)
        discard(self.temp)

"""Stream one planned shard to disk and publish it durably.

The header is known before the first tensor (the plan fixes every dtype and shape), so tensors are written
straight to a temp file in data order — no shard is ever assembled in RAM, and two output tensors never share
a buffer (the "Some tensors share memory" failure cannot happen). :meth:`ShardWriter.finish` runs the commit
protocol up to the sink's publish; the caller journals the file from the receipt
(:class:`~resumerge.store.journal_commit.CommitJournal`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from resumerge.errors import ResumergeError
from resumerge.inputs.safetensors_format import ShardLayout, read_header
from resumerge.inputs.tensorio import TORCH_DTYPES, tensor_bytes
from resumerge.store import killpoints
from resumerge.store.durable import discard, storage_error, sync_file
from resumerge.store.sink import OutputSink, Receipt
from resumerge.torch_import import torch

_PARALLEL_HASH_BYTES = 1 << 20
_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    """The process's one hashing thread (shards are written one at a time, by one writer thread)."""
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resumerge-hash")
        return _HASHER


def start_hashing() -> None:
    """Start the process's hashing thread now, if it is not running, from the calling thread.

    A thread starts with its creator's scheduling priority (Linux) and keeps it for the process's life: started by
    a writer that yields the CPU to a run's transfers (:mod:`resumerge.engine.cpupriority`), it would hash every
    later run's shards at that lower priority too, the local runs of a notebook included. The engine calls this
    from the run's own thread before any of its threads lowers its priority.
    """
    _hasher().submit(int).result()  # the pool's one thread starts at its first task


class ShardWriter:
    """Writes the tensors of one shard, in layout order, to the temp file its output sink hands out, and publishes
    it through the sink (beside the final file on a local disk; staged and copied for Drive and other mounts)."""

    def __init__(self, sink: OutputSink, name: str, layout: ShardLayout) -> None:
        self.sink, self.name = sink, name
        self.final = sink.where(name)
        self.layout = layout
        self.temp = sink.temp_for(name)
        self._next = 0
        self._sha = hashlib.sha256()
        self._written = 0
        self._part = 0
        try:
            self._fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._write(memoryview(layout.header))
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc

    @property
    def expected_name(self) -> str | None:
        """The tensor the writer needs next, or None when the shard is complete."""
        return self.layout.order[self._next].name if self._next < len(self.layout.order) else None

    def write(self, name: str, tensor: torch.Tensor) -> bool:
        """Append ``tensor`` — all of output tensor ``name``, or its next rows — in planned order.

        Returns True once all the tensor's bytes are written, False after a partial write. Raises if ``name``
        is not the planned next tensor or the dtype, shape or size disagree with the plan.
        """
        planned = self.layout.order[self._next] if self._next < len(self.layout.order) else None
        if planned is None or planned.name != name:
            raise ResumergeError(f"internal: {self.final.name} expected {planned and planned.name}, got {name}")
        shape = tuple(tensor.shape)
        whole = self._part == 0 and shape == planned.shape
        if tensor.dtype != TORCH_DTYPES[planned.dtype] or not (whole or shape[1:] == planned.shape[1:]):
            raise ResumergeError(
                f"internal: {name} is {tensor.dtype} {shape}, planned {planned.dtype} {planned.shape}"
            )
        data = tensor_bytes(tensor.contiguous())
        if self._part + len(data) > planned.nbytes:
            raise ResumergeError(f"internal: {name} got more bytes than planned")
        try:
            self._write(data)
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc
        self._part += len(data)
        if self._part < planned.nbytes:
            return False
        self._part = 0
        self._next += 1
        if self._next == 1:
            killpoints.reach("mid_shard_write")
        return True

    def _write(self, data: memoryview) -> None:
        # Hash on a helper thread while this one writes: both release the GIL, and sha256 alone costs as much CPU
        # as the write. Waiting before returning keeps the hash in file order and ``data`` alive while it is read.
        hashed = _hasher().submit(self._sha.update, data) if len(data) >= _PARALLEL_HASH_BYTES else None
        if hashed is None:
            self._sha.update(data)
        try:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        finally:
            if hashed is not None:
                hashed.result()
        self._written += len(data)

    def finish(self) -> tuple[int, str, Receipt]:
        """fsync, verify the header and size, and publish through the sink (local: rename, fsync the directory;
        staged: copy, read back, verify, rename).

        Returns (size, sha256, receipt). When the receipt is settled already the file is durable under its final
        name; only the ledger row is missing, and resume deletes a final-named file that has none. Otherwise the
        sink commits it later (see :meth:`~resumerge.store.sink.OutputSink.publish`).
        """
        if self._next != len(self.layout.order):
            raise ResumergeError(f"internal: shard {self.final.name} finished with tensors missing")
        try:
            killpoints.reach("after_temp_write")
            sync_file(self._fd)
            os.close(self._fd)
            self._fd = -1
            killpoints.reach("after_fsync")
            header = read_header(self.temp)
            if header.file_size != self.layout.file_size or self._written != self.layout.file_size:
                raise ResumergeError(f"internal: {self.final.name} is {header.file_size} bytes, planned "
                                     f"{self.layout.file_size}")
            receipt = self.sink.publish(self.temp, self.name, self._sha.hexdigest())
        except OSError as exc:
            self.abort()
            raise storage_error(exc, self.final) from exc
        return self.layout.file_size, self._sha.hexdigest(), receipt

    def abort(self) -> None:
        """Close and delete the temp file (safe to call more than once; never raises, so the error being
        handled is the one reported)."""
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            self._fd = -1
            with contextlib.suppress(OSError):
                os.close(fd)
        discard(self.temp)

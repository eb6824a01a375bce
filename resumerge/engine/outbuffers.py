"""Buffers for the outputs the merge workers hand to the writer, taken back once written and lent again.

What a worker hands the writer is a tensor of its own, made at the end of each tensor's computation: block-FP8 codes
encoded, a result cast to its stored dtype, a result stored as computed copied out of the worker's workspace. Above
glibc's mmap threshold (:mod:`resumerge.memory.allocator`) each fresh one is mapped afresh and the kernel zero-fills
every page of it at first touch, just before the encode or the copy overwrites it. So a run keeps one
:class:`OutputBuffers`: the workers take each output's buffer from it (:meth:`OutputBuffers.take`), and the writer
gives the buffers back once their bytes are written (:meth:`OutputBuffers.give_back`; a write copies them into the
page cache, and nothing refers to them after), to be lent to a later output of the same size — a checkpoint's layers
repeat a few sizes.

A buffer lent out is its unit's output, which the unit's reservation covers until the writer has it, as it covered a
fresh one. What lies given back and not lent again is held between units, like the workspaces' buffers: at most
``most`` bytes (a share of the memory budget beside theirs, :func:`output_bytes`), seen by the governor in the
process's RSS, and all of it goes back to the system when the governor must make room (:meth:`OutputBuffers.trim`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

from resumerge.torch_import import torch

# The share of the memory budget that idle output buffers may hold (the workspaces hold theirs beside it), and what
# they may hold without a budget.
OUTPUT_SHARE = 0.125
UNBUDGETED = 256 << 20
# Smaller buffers come from the heap, which reuses them already (the mmap threshold tune_allocator sets).
SMALLEST = 1 << 20


def output_bytes(budget: int | None) -> int:
    """What a run's idle output buffers may hold under a memory ``budget`` (None: no budget)."""
    return UNBUDGETED if budget is None else int(budget * OUTPUT_SHARE)


class OutputBuffers:
    """Output buffers lent by :meth:`take` and given back by :meth:`give_back`, keeping at most ``most`` bytes of
    them idle. Thread-safe: the workers take, the writer gives back."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # uint8 buffers, given back oldest first
        self._held = 0
        self._lent: set[int] = set()  # the data pointers of buffers lent and not given back

    @property
    def held_bytes(self) -> int:
        """What the idle buffers hold now."""
        with self._lock:
            return self._held

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, a whole buffer of its own: one given
        back of that size when there is one, else a fresh one."""
        size = dtype.itemsize * math.prod(shape)
        if size < SMALLEST:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            found = next((i for i in range(len(self._idle) - 1, -1, -1) if self._idle[i].numel() == size), None)
            buffer = self._idle.pop(found) if found is not None else None
            self._held -= size if buffer is not None else 0
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8)
        with self._lock:
            self._lent.add(buffer.data_ptr())
        return buffer.view(dtype).view(shape)

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take back each of ``tensors`` that is a whole buffer :meth:`take` lent (the caller is done with it and
        holds no other view of it), to lend again; the oldest idle buffers are dropped to keep within ``most``.
        Other tensors are left alone."""
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            if size < SMALLEST or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != size:
                continue
            with self._lock:
                if tensor.data_ptr() not in self._lent:
                    continue
                self._lent.discard(tensor.data_ptr())
                if size > self.most:
                    continue
                while self._held + size > self.most:
                    self._held -= self._idle.pop(0).numel()
                self._idle.append(tensor.reshape(-1).view(torch.uint8))
                self._held += size

    def trim(self) -> int:
        """Drop every idle buffer; returns the bytes they held."""
        with self._lock:
            held, self._held = self._held, 0
            self._idle.clear()
            return held

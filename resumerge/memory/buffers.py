"""Buffers reused from one candidate's tensors to the next candidate's inside a block: what a generation's pass
casts each merged weight into, and what each merge writes its result into.

A merge never written hands the reader each tensor in its stored dtype (bfloat16, say), which the reader casts to
the pass's dtype (float32). Each into a fresh buffer, every tensor over 1 MiB is a fresh map the kernel faults in
and zeroes page by page (:mod:`resumerge.memory.allocator`): a bfloat16 -> float32 cast into a fresh buffer cost
3.5-4.5x the cast into a reused one (2816 x 1024, bench/RESULTS.md, issue 68), and a generation of 8 candidates
over 16 layers casts 5.8 GB of them. Inside :meth:`ReusedBuffers.reusing`, a tensor its holder drops (a weight as its
module is unloaded, a merge's result once cast) hands its buffer back, and the next one of as many values (the next
candidate's same tensor) takes it instead of a fresh one.

Only what the pool lent is taken back, and only while its holder still holds it (the pool keeps a weak reference to
what it lent: a buffer never handed back is freed as any tensor is). What the block holds beyond a pass without it:
the buffers handed back and not taken again yet (one candidate's tensors, which the next takes again as it reads
its own), let go when the block ends.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from resumerge.memory.allocator import MMAP_THRESHOLD
from resumerge.torch_import import torch


class ReusedBuffers:
    """Buffers reused inside :meth:`reusing` (see the module docstring). Thread-safe; outside the block every
    buffer is fresh and nothing is kept. ``smallest``: the fewest bytes of a buffer reused (below the allocator's
    map threshold a buffer comes from the heap, whose pages are faulted in already)."""

    def __init__(self, smallest: int = MMAP_THRESHOLD) -> None:
        self.smallest = smallest
        self._lock = threading.Lock()
        self._on = False
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        # What was lent, by the address of its storage: (values, dtype, a weak reference to the storage).
        # (torch keeps one Python object per storage while any tensor holds it: the reference dies with the last.)
        self._lent: dict[int, tuple[int, torch.dtype, weakref.ref[torch.UntypedStorage]]] = {}
        self.taken = 0  # buffers handed out again (for tests: the reuse happened)

    @contextmanager
    def reusing(self) -> Iterator[None]:
        """The block in which buffers handed back are reused; every buffer kept is let go when it ends."""
        with self._lock:
            self._on = True
        try:
            yield
        finally:
            with self._lock:
                self._on = False
                self._free.clear()
                self._lent.clear()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous host tensor of ``shape`` and ``dtype``, the caller's until it hands it back
        with :meth:`give`: one handed back inside the block where one of as many values is free, else fresh."""
        count = 1
        for size in shape:
            count *= size
        if count == 0 or count * dtype.itemsize < self.smallest:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            if not self._on:
                return torch.empty(shape, dtype=dtype)
            free = self._free.get((count, dtype))
            if free:
                buffer = free.pop()
                self.taken += 1
            else:
                buffer = torch.empty(count, dtype=dtype)
            storage = buffer.untyped_storage()
            self._lent[storage.data_ptr()] = (count, dtype, weakref.ref(storage))
        return buffer.view(shape)

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (on the host) cast to ``dtype`` into a buffer of :meth:`take`: the same values as
        ``value.to(dtype, copy=True)``."""
        if value.device.type != "cpu":
            return value.to(dtype, copy=True)
        out = self.take(tuple(value.shape), dtype)
        out.copy_(value)
        return out

    def give(self, tensor: torch.Tensor) -> None:
        """``tensor`` (or a view of all of it), which its holder drops: where the pool lent it inside the block,
        its buffer is free for the next :meth:`take` of as many values; any other tensor is left alone."""
        if tensor.is_meta or tensor.device.type != "cpu":
            return
        storage = tensor.untyped_storage()
        with self._lock:
            lent = self._lent.get(storage.data_ptr()) if self._on else None
            if lent is None:
                return
            count, dtype, ref = lent
            if (ref() is not storage or tensor.dtype != dtype
                    or tensor.numel() != count or tensor.storage_offset() != 0):
                return
            del self._lent[storage.data_ptr()]
            flat = torch.empty(0, dtype=dtype).set_(storage, 0, (count,), (1,))
            self._free.setdefault((count, dtype), []).append(flat)

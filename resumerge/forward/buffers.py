"""The buffers a pass's reader casts computed weights into, reused from one model's layer to the next model's.

A merge never written hands the reader each tensor in its stored dtype (bfloat16, say), which the reader casts to
the pass's dtype (float32). Cast into a fresh buffer, every tensor over 1 MiB is a fresh map the kernel faults in
and zeroes page by page (:mod:`resumerge.memory.allocator`): a bfloat16 -> float32 cast into a fresh buffer cost
3.5-4.5x the cast into a reused one (2816 x 1024, bench/RESULTS.md, issue 68), and a generation of 8 candidates
over 16 layers casts 5.8 GB of them. Inside :meth:`CastBuffers.reusing`, a weight the stream drops (its module
unloaded) hands its buffer back, and the next cast of as many values (the next candidate's same tensor) takes it
instead of a fresh one: the pages are faulted in once per block, not once per candidate.

What the block holds beyond what the pass held without it: between two models' layers, the buffers of the last
one, which the next one takes again as it reads its own (at most one model's layer in the pass's dtype, which the
pass's step already counts); dropped when the block ends, so that a step outside it (a parent's layer) never holds
them. Only the buffers it lent are taken back: a tensor the reader did not cast (a parameter given by the caller)
is never reused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from resumerge.memory.allocator import MMAP_THRESHOLD
from resumerge.torch_import import torch


class CastBuffers:
    """The buffers a reader casts into (see the module docstring). Thread-safe; outside :meth:`reusing` every
    cast is into a fresh tensor and nothing is kept. ``smallest``: the fewest bytes of a buffer reused (below the
    allocator's map threshold a buffer comes from the heap, whose pages are faulted in already)."""

    def __init__(self, smallest: int = MMAP_THRESHOLD) -> None:
        self._smallest = max(1, smallest)
        self._lock = threading.Lock()
        self._on = False
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # by the address of their storage
        self.taken = 0  # casts into a buffer handed back (for tests: the reuse happened)

    @contextmanager
    def reusing(self) -> Iterator[None]:
        """The block in which dropped buffers are reused; every buffer kept is let go when it ends."""
        with self._lock:
            self._on = True
        try:
            yield
        finally:
            with self._lock:
                self._on = False
                self._free.clear()
                self._lent.clear()

    def cast(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` (on the host) cast to ``dtype``: a tensor of the caller's own, the same values as
        ``value.to(dtype, copy=True)``; inside :meth:`reusing`, a buffer handed back by :meth:`give` where one of
        as many values is free (a tensor under ``smallest`` bytes: always fresh)."""
        count = value.numel()
        if value.device.type != "cpu" or count * dtype.itemsize < self._smallest:
            return value.to(dtype, copy=True)
        with self._lock:
            if not self._on:
                return value.to(dtype, copy=True)
            free = self._free.get((count, dtype))
            if free:
                buffer = free.pop()
                self.taken += 1
            else:
                buffer = torch.empty(count, dtype=dtype)
            self._lent[buffer.untyped_storage().data_ptr()] = buffer
        out = buffer.view(value.shape)
        out.copy_(value)
        return out

    def give(self, tensor: torch.Tensor) -> None:
        """``tensor``, dropped by its holder (nothing else may hold it): its buffer is free for the next cast of as
        many values where this pool lent it inside the block; any other tensor is left alone."""
        if tensor.is_meta or tensor.device.type != "cpu":
            return
        with self._lock:
            if not self._on:
                return
            buffer = self._lent.get(tensor.untyped_storage().data_ptr())
            if buffer is None or buffer.numel() != tensor.numel() or buffer.dtype != tensor.dtype:
                return
            del self._lent[buffer.untyped_storage().data_ptr()]
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

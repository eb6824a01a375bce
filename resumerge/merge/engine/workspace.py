"""Buffers a merge worker reuses from one tensor to the next: decoded inputs and the method's result.

A float32 buffer above glibc's mmap threshold is mapped fresh at each allocation, and the kernel zero-fills every
page of it at first touch: decoding one 5632x2048 block-FP8 tensor into a fresh buffer cost 54 ms of CPU against
27 ms into a reused one, and a linear merge's fresh accumulator doubled its cost the same way. So each worker
computing whole tensors keeps a :class:`Workspace` — one buffer per use (each input's decoded value, the method's
result), grown to the largest that worker needed — and lends it again to its next tensor.

What a workspace lends is valid until the tensor it was lent for is computed: the engine copies any stored result
that still points into it (:meth:`Workspace.holds`) before it lends the buffers again. A buffer larger than the
workspace's ``most`` bytes is allocated fresh and not kept, and a run keeps at most one workspace per worker, so what
the workspaces hold between tensors stays a bounded share of the memory budget; the governor sees it in the process's
RSS (its baseline), and each tensor's reservation already counts the decoded inputs and the result it computes in
them. Where the governor must make room (a unit it would admit alone over the headroom) the idle workspaces give their
buffers back (:meth:`Workspaces.trim`): the planner sizes units against the whole budget, not against what is left
beside the workspaces.

Its uses (keys): each input's stored bytes (``raw<i>``) and decoded value (``input<i>``), the method's result
(``result``) and that result cast to the output's dtype (``cast``, linear's float32 sum as bfloat16), a GGUF block
type's float32 values (``gguf-values``) and the stored parts a whole tensor or a range of chunks is encoded into
(``out:<part>``, passed on to the writer). Each would otherwise be a fresh tensor-sized buffer per tensor.

Inputs stored as the method reads them (plain float32, bfloat16...) are read into the workspace's buffers too, by
``pread`` straight into pages already faulted in. A result stored as it was computed is not copied out where the run
has a :class:`~resumerge.merge.engine.bufferpool.BufferPool`: the workspace passes its buffer on to the writer
(:meth:`Workspace.pass_on`) and grows its next buffer from those the writer gave back. Both only from
:data:`WARM_BYTES` up: a smaller input is read into, and a smaller result computed in, a fresh buffer from the
allocator's warm heap for less than the workspace's bookkeeping costs, and the result stored as it is (no copy).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from resumerge.machine.torch_import import torch
from resumerge.merge.engine.bufferpool import BufferPool

# The share of the memory budget that the workspaces of all workers may hold between tensors, and what they may hold
# without a budget (a run without a governor).
BUDGET_SHARE = 0.5
UNBUDGETED = 1 << 30
# Below this many bytes a fresh buffer comes from the allocator's warm heap (glibc serves requests under its mmap
# threshold, 128 KiB to 32 MiB, from pages already faulted in): a plain input is read into a fresh one, and a result
# copied out rather than passed on. What the workspace and the pool save is a large buffer's zero-filled pages; for
# small tensors their bookkeeping cost more (a run of 18k tiny tensors: 1.18x the CPU, bench/many_first_run.py).
WARM_BYTES = 1 << 20


def workspace_bytes(budget: int | None, workers: int) -> int:
    """What each of ``workers`` workspaces may hold under a memory ``budget`` (None: no budget)."""
    if budget is None:
        return UNBUDGETED
    return int(budget * BUDGET_SHARE) // max(1, workers)


class Workspace:
    """One worker's buffers by use (``key``), holding at most ``most`` bytes in all; used by one thread at a
    time. With a ``pool``, new buffers come from those the writer gave back, and a result stored as computed is
    passed on to the writer rather than copied (:meth:`pass_on`). Under ``warm_bytes`` it lends fresh tensors,
    none of its own (:data:`WARM_BYTES`)."""

    def __init__(self, most: int, pool: BufferPool | None = None, warm_bytes: int = WARM_BYTES) -> None:
        self.most = most
        self._pool = pool
        self._warm_bytes = warm_bytes
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        """What the buffers hold now."""
        return sum(b.numel() for b in self._buffers.values())

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``: ``key``'s buffer, grown to fit when
        the workspace can hold it, else a fresh tensor; a fresh one too under the workspace's ``warm_bytes`` (and
        ``key``'s buffer kept as it is). It replaces what ``key`` lent before."""
        size = dtype.itemsize * math.prod(shape)
        if size < self._warm_bytes:
            # From the allocator's warm heap, as cheap as the buffer's bookkeeping, and never in the workspace: a
            # tiny result is stored as it is, not copied out (90k tiny tensors: 90k clones and refused pass_ons).
            return torch.empty(shape, dtype=dtype)
        held = self._buffers.pop(key, None)
        if held is not None and held.numel() >= size:
            self._buffers[key] = held
        else:
            del held  # freed before its larger successor is allocated
            if self.held_bytes + size > self.most:
                return torch.empty(shape, dtype=dtype)
            held = self._buffers[key] = (torch.empty(size, dtype=torch.uint8) if self._pool is None
                                         else self._pool.take(size))
        return held[:size].view(dtype).view(shape)

    @property
    def passes_on(self) -> bool:
        """Whether a result in the buffers can be handed to the writer (:meth:`pass_on`: the workspace has a pool)
        rather than copied out."""
        return self._pool is not None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` shares memory with one of the buffers."""
        if not self._buffers or tensor.device.type != "cpu":
            return False
        storage = tensor.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == storage for b in self._buffers.values())

    def pass_on(self, tensor: torch.Tensor) -> bool:
        """Hand the buffer ``tensor`` lives in (contiguous) to the writer through the pool, and forget it: the
        tensor is then stored as it is, and this workspace's next use of its key takes another buffer. False
        (nothing changes: the caller copies the tensor out) without a pool, for a tensor in none of the buffers or
        not contiguous, or one under the workspace's ``warm_bytes`` (cheaper copied)."""
        if (self._pool is None or tensor.device.type != "cpu" or not tensor.is_contiguous()
                or tensor.numel() * tensor.element_size() < self._warm_bytes):
            return False
        storage = tensor.untyped_storage().data_ptr()
        for key, buffer in self._buffers.items():
            if buffer.untyped_storage().data_ptr() == storage:
                self._pool.pass_on(self._buffers.pop(key))
                return True
        return False

    def clear(self) -> int:
        """Drop every buffer (the next :meth:`take` allocates afresh); returns the bytes they held."""
        held = self.held_bytes
        self._buffers.clear()
        return held


class Workspaces:
    """The workspaces of one run's ``workers``: :meth:`lend` one to each computation running at once, each holding
    at most ``most`` bytes. At most ``workers`` are kept; a computation beyond them (none should be: the engine runs
    at most ``workers`` at once) is lent one that keeps nothing. ``pool``: where their buffers come from and their
    results go; ``warm_bytes``: the least they lend of their own (see :class:`Workspace`). Thread-safe."""

    def __init__(self, most: int, workers: int, pool: BufferPool | None = None, warm_bytes: int = WARM_BYTES) -> None:
        self.most, self.workers, self.pool, self.warm_bytes = most, workers, pool, warm_bytes
        self._lock = threading.Lock()
        self._idle: list[Workspace] = []
        self._made = 0

    @contextmanager
    def lend(self) -> Iterator[Workspace]:
        """A workspace no other thread uses until the block ends (the one used last, whose pages are warm)."""
        with self._lock:
            if self._idle:
                workspace, kept = self._idle.pop(), True
            elif self._made < self.workers:
                self._made += 1
                workspace, kept = Workspace(self.most, self.pool, self.warm_bytes), True
            else:
                workspace, kept = Workspace(0), False
        try:
            yield workspace
        finally:
            if kept:
                with self._lock:
                    self._idle.append(workspace)

    def trim(self) -> int:
        """Drop the buffers of every workspace not lent now, and the pool's idle ones; returns the bytes given
        back."""
        with self._lock:
            held = sum(workspace.clear() for workspace in self._idle)
        return held + (self.pool.trim() if self.pool is not None else 0)

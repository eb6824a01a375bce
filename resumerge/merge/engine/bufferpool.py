"""Result buffers that go to the writer and come back: a merge's output bytes written from the buffer they were
computed in, whose pages the next tensor reuses.

A worker computes a tensor in its workspace's buffers (:mod:`resumerge.merge.engine.workspace`); a result stored as it
was computed (a float32 merge written as float32) used to be copied out of the workspace before the writer got it, so
that the next tensor could use the buffer again: a copy of every output byte into fresh pages, which the kernel
zero-fills at first touch (a linear merge of two 1.74 GB models: 1.74 GB copied, 0.45 million minor faults). Instead
the workspace *passes on* the buffer holding such a result (:meth:`BufferPool.pass_on`): it forgets it, the writer
writes the tensor straight from it and :meth:`gives it back <BufferPool.give_back>` once the bytes are in the file,
and the next buffer a workspace grows is taken from those given back (:meth:`BufferPool.take`), its pages warm.

What the pool holds is bounded twice: a buffer out (passed on, not yet written) is part of its unit's memory
reservation until the writer releases it, as a fresh copy was; the idle ones are at most ``most`` bytes (the oldest
dropped first), in the process's RSS as the workspaces' buffers are (the governor's baseline), and given back to the
allocator with them when the governor must make room (:meth:`trim`). A buffer is taken only for a request of at
least half its size, so a small tensor never holds a large buffer's pages, and at most :data:`MOST_IDLE` buffers
wait idle: a buffer is found by a scan of them, and a run of many small tensors (90k of them) piled up tens of
thousands of idle buffers and scanned them all for every tensor (a 18k-tensor linear merge: 1.18x the CPU of the
tree before the pool, ``bench/many_first_run.py``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from resumerge.machine.torch_import import torch

# The idle buffers kept at most: a few per worker (the writer gives a unit's buffers back together), bounded so that
# finding one stays a short scan whatever the number of tensors.
MOST_IDLE = 32


class BufferPool:
    """uint8 CPU buffers lent as workspaces' buffers, passed on to the writer with the tensor computed in them, and
    given back once written. Thread-safe (the workers take and pass on, the writer gives back)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._idle: deque[torch.Tensor] = deque()  # oldest first
        self._out: dict[int, torch.Tensor] = {}  # passed on, by the address of their storage

    @property
    def idle_bytes(self) -> int:
        """What the idle buffers hold."""
        with self._lock:
            return sum(b.numel() for b in self._idle)

    @property
    def out(self) -> int:
        """How many buffers are passed on and not given back yet."""
        with self._lock:
            return len(self._out)

    def take(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 buffer of at least ``nbytes`` (uninitialised): the smallest idle one that fits and is
        at most twice as large, else a fresh one."""
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                best = min(fits, key=lambda i: self._idle[i].numel())
                buffer = self._idle[best]
                del self._idle[best]  # by place: a deque's remove() compares tensors by value
                return buffer
        return torch.empty(nbytes, dtype=torch.uint8)

    def pass_on(self, buffer: torch.Tensor) -> None:
        """``buffer`` (one :meth:`take` gave) now holds a tensor on its way to the writer, which gives it back."""
        with self._lock:
            self._out[_address(buffer)] = buffer

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """The writer is done with ``tensors``: the passed-on buffers they live in become idle (others are not the
        pool's and are left alone)."""
        if not self._out:
            # None out, so none of ``tensors`` is the pool's (each was passed on before the writer had it): a run
            # of tiny tensors, none passed on, looked up every one (90k of them, each its storage's address).
            return
        with self._lock:
            for tensor in tensors:
                if tensor.device.type != "cpu":
                    continue
                buffer = self._out.pop(_address(tensor), None)
                if buffer is None:
                    continue
                self._idle.append(buffer)
            held = sum(b.numel() for b in self._idle)
            while held > self.most or len(self._idle) > MOST_IDLE:
                held -= self._idle.popleft().numel()

    def trim(self) -> int:
        """Drop every idle buffer; returns the bytes they held."""
        with self._lock:
            held = sum(b.numel() for b in self._idle)
            self._idle.clear()
            return held


def _address(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())

"""Memory probes: where the governor learns how much memory we use and how much is left.

The governor never reads the OS itself; it asks a :class:`MemoryProbe`. :class:`SystemProbe` reads host RAM
(psutil) and the container's cgroup, :class:`~resumerge.machine.memory.cuda.CudaProbe` a GPU, and
:class:`~resumerge.machine.memory.fake.FakeProbe` whatever a test scripts.
"""

from __future__ import annotations

import gc
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import psutil

from resumerge.machine.memory import allocator, cgroup
from resumerge.machine.memory.baseline import resident_bytes

__all__ = ["MemoryProbe", "SystemProbe", "os_peak_rss"]


@runtime_checkable
class MemoryProbe(Protocol):
    """What the governor needs to know about one memory pool (host RAM or one GPU). Must be thread-safe."""

    def rss(self) -> int:
        """Bytes this process holds in the pool that count against its budget."""
        ...

    def available(self) -> int:
        """Bytes that can still be allocated now without swapping, throttling or an OOM kill."""
        ...

    def limit(self) -> int | None:
        """The pool's hard ceiling in bytes (physical RAM or the container limit), ``None`` if unknown."""
        ...

    def reclaim(self) -> None:
        """Best effort: return freed memory to the OS (or driver) so that :meth:`rss` drops."""
        ...


class SystemProbe:
    """Host memory as the kernel will enforce it: psutil for the machine, the cgroup for the container.

    ``rss()`` is the process's whole resident set (``VmRSS`` of ``/proc/self/status``; psutil's RSS elsewhere), the
    one meaning of ``--max-memory`` in every command: what ``top``, ``/usr/bin/time`` and the OS's peak
    (:func:`os_peak_rss`) report. Its mapped library files (torch's, about 80 MB) count as well: a budget that left them
    out was exceeded by them. A merge reads its inputs with ``pread``, so no input file is mapped; a check's mapped
    spans are the tensors it holds.

    ``available()`` is ``min(psutil available, cgroup limit − cgroup working set)`` because psutil reports the
    host's memory inside containers. ``limit()`` is ``min(physical RAM, cgroup limit)``.
    """

    def __init__(self, root: str | Path = "/") -> None:
        self._root = Path(root)
        self._group = cgroup.locate(self._root)
        self._process = psutil.Process()
        self._status = self._root / "proc/self/status"
        self._trim: Callable[[int], int] | None = allocator.malloc_trim()

    @property
    def group(self) -> cgroup.CgroupMemory | None:
        """The memory cgroup this probe reads, ``None`` when none was found."""
        return self._group

    def rss(self) -> int:
        """See the class docstring: the resident set (``VmRSS``) on Linux, psutil's RSS elsewhere."""
        counted = resident_bytes(self._status)
        return counted if counted is not None else int(self._process.memory_info().rss)

    def available(self) -> int:
        """Host ``MemAvailable``, lowered to the cgroup's headroom when a container limit applies."""
        host = int(psutil.virtual_memory().available)
        if self._group is None:
            return host
        limit = cgroup.memory_limit(self._group)
        used = cgroup.working_set(self._group)
        if limit is None or used is None:
            return host
        return max(0, min(host, limit - used))

    def limit(self) -> int:
        """Physical RAM, or the cgroup limit when that is smaller."""
        total = int(psutil.virtual_memory().total)
        container = cgroup.memory_limit(self._group) if self._group is not None else None
        return total if container is None else min(total, container)

    def reclaim(self) -> None:
        """Collect garbage cycles (they may hold tensors) and ask glibc to return free heap pages to the OS.

        glibc keeps freed heap blocks for reuse (a run keeps row chunks' buffers on purpose, see
        :mod:`resumerge.machine.memory.allocator`), so RSS stays above what is in use; ``malloc_trim(0)`` gives those
        pages back. A no-op where glibc is absent.
        """
        gc.collect()
        if self._trim is not None:
            self._trim(0)


def os_peak_rss() -> int | None:
    """Return this process's lifetime peak RSS in bytes as the OS measured it (``ru_maxrss``), if known.

    Unlike the governor's sampled peak this misses no spike; it counts what the budget counts (the whole resident
    set). On Linux it is ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` survives exec, so a merge started by
    ``subprocess.run`` from a large process (a notebook kernel holding a model) would report that process's size.
    """
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(encoding="ascii",
                                                                                     errors="replace"), re.M)
    except OSError:
        found = None
    if found is not None:
        return int(found[1]) * 1024
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows): what the
    estimates of the merge and of the MoE prompt pass share out."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1

"""How the C allocator treats the buffers a merge frees (glibc only; a no-op elsewhere).

Two settings, made once per run by :func:`tune_allocator`:

* Buffers over 1 MiB (tensors) are mapped on their own and unmapped when freed, so RSS follows the tensors in
  flight, which is what the memory governor reads. glibc would otherwise raise this threshold after each large
  free, and later tensor-sized buffers would stay in RSS after they are freed.
* Freed heap memory (the row chunks' buffers, at most 1 MiB each) stays with the process for the next chunk
  instead of going back to the OS whenever 128 KiB lie free at the top of a heap. Given back, every later chunk
  faults its pages in again and the kernel zeroes each one. The bench's della merge of 5 GB of inputs under
  ``--max-memory 1GB`` (row chunks): 3.5 million page faults given back, 0.26 million kept; system time 12.0 s
  against 8.0 s, wall time 26.0 against 23.0 s (medians, bench/RESULTS.md). What is kept is bounded by the chunks
  in flight (peak RSS +11 MiB there), and the governor's :meth:`~resumerge.machine.memory.probe.MemoryProbe.reclaim`
  hands it back (``malloc_trim``) when memory runs short.

The settings are the whole process's, so a run puts them back when it ends (a notebook that called ``api.run``
keeps its own allocator behaviour): :func:`tune_allocator` returns the function that does, and only the outermost
of overlapping runs restores. glibc has no getter for these thresholds, so what is restored is what the process
started with: glibc's defaults (128 KiB each) or the ``MALLOC_*_THRESHOLD_`` / ``GLIBC_TUNABLES`` values it was
started with. (glibc's default mmap threshold then rises after large frees; once set by ``mallopt`` it stays put,
so the restored one stays at its starting value.)

May import: nothing from resumerge.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "malloc_trim", "tune_allocator"]

# mallopt's parameter numbers (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

MMAP_THRESHOLD = 1 << 20
# Non-main glibc heaps (the worker threads') are at most 64 MiB, so they keep their free top whole; the main heap
# gives back what lies free beyond this.
TRIM_THRESHOLD = 64 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


# glibc's thresholds when nothing sets them (malloc.h: DEFAULT_MMAP_THRESHOLD_MIN, DEFAULT_TRIM_THRESHOLD).
_GLIBC_DEFAULT = 128 << 10
_lock = threading.Lock()
_tuned = 0  # runs holding the settings now


def tune_allocator() -> Callable[[], None] | None:
    """Set both thresholds (see the module's docstring). Return the function that puts back the process's own
    settings once no other run holds these (call it when the run ends), or None when the C library did not take
    them."""
    global _tuned
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return None
    with _lock:
        # mallopt returns 1 on success; musl has the symbol and ignores every parameter (returns 0).
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            return None
        _tuned += 1
    released = threading.Event()

    def restore() -> None:
        global _tuned
        with _lock:
            if released.is_set():
                return
            released.set()
            _tuned -= 1
            if _tuned == 0:
                mallopt(_M_MMAP_THRESHOLD, _startup_setting("MALLOC_MMAP_THRESHOLD_", "mmap_threshold"))
                mallopt(_M_TRIM_THRESHOLD, _startup_setting("MALLOC_TRIM_THRESHOLD_", "trim_threshold"))

    return restore


def _startup_setting(variable: str, tunable: str) -> int:
    """The threshold glibc started this process with: its ``GLIBC_TUNABLES`` entry, the older ``MALLOC_…_``
    variable, else glibc's default."""
    for entry in os.environ.get("GLIBC_TUNABLES", "").replace(":", " ").split():
        name, _, value = entry.partition("=")
        if name == f"glibc.malloc.{tunable}" and value.isdigit():
            return int(value)
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() else _GLIBC_DEFAULT


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (give free heap pages back to the OS), or None where there is none (musl)."""
    return getattr(_libc(), "malloc_trim", None)


def give_back_heap() -> None:
    """Collect what Python let go and hand the heap's free pages back to the OS (``malloc_trim``; nothing where
    there is none): what a process holds after it, read as the baseline a pass runs beside, is that pass's, not
    what was freed before it (lm-eval's task loading and tokenizing: ~80-130 MB on SmolLM2, back to the OS at the
    pass's first trimmed step, yet counted by the budget judged before it)."""
    import gc

    gc.collect()
    trim = malloc_trim()
    if trim is not None:
        trim(0)

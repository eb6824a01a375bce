"""The C allocator's settings for a run: chunk-sized buffers freed by a worker thread are reused, not faulted in
again, while tensor-sized ones still go back to the OS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")

# Runs in a fresh interpreter (the settings are process-wide): allocates, touches and frees a 512 KiB buffer (a
# row chunk's size) 200 times on a worker thread, as the engine's workers do, and counts the minor page faults;
# then maps a 64 MiB buffer (a tensor) and frees it, and reads whether RSS dropped again.
_PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, json, resource, sys, threading
    from resumerge.machine.memory import allocator
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "tuned":
        took = allocator.tune_allocator() is not None
    elif sys.argv[1] == "restored":  # a run that ended: the process's own settings are back
        restore = allocator.tune_allocator()
        took = restore is not None
        restore()
    elif sys.argv[1] == "overlapping":  # of two overlapping runs, the first ends: the second keeps the settings
        first, second = allocator.tune_allocator(), allocator.tune_allocator()
        took = first is not None and second is not None
        first()
        first()  # twice is once
    else:  # the mmap threshold alone, as runs set it before
        took = bool(libc.mallopt(-3, allocator.MMAP_THRESHOLD))

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def chunks(result):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(200):
            pointer = libc.malloc(512 << 10)
            ctypes.memset(pointer, 1, 512 << 10)
            libc.free(pointer)
        result["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        start = rss()
        pointer = libc.malloc(64 << 20)
        ctypes.memset(pointer, 1, 64 << 20)
        result["grew"] = rss() - start
        libc.free(pointer)
        result["kept"] = rss() - start

    result = {"took": took}
    worker = threading.Thread(target=chunks, args=(result,))
    worker.start()
    worker.join()
    print(json.dumps(result))
""")


def _probe(mode: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                          timeout=120)
    result: dict[str, int] = json.loads(done.stdout)
    return result


def test_freed_chunks_are_reused_without_new_page_faults_and_tensors_still_go_back() -> None:
    tuned, before = _probe("tuned"), _probe("threshold-only")
    assert tuned["took"] and before["took"]
    pages = (512 << 10) // 4096
    # Given back at each free, every chunk faults its 128 pages in again; kept, only the first one does.
    assert before["faults"] >= 100 * pages
    assert tuned["faults"] <= 10 * pages
    # A tensor-sized buffer is still mapped on its own and unmapped when freed: RSS follows the tensors in flight.
    for result in (tuned, before):
        assert result["grew"] >= 60 << 20
        assert result["kept"] <= 4 << 20


def test_a_run_puts_the_process_allocator_settings_back_when_it_ends() -> None:
    """tune_allocator changed glibc's thresholds for the whole process and never restored them (a notebook kept
    the merge's settings after api.run returned)."""
    restored, overlapping = _probe("restored"), _probe("overlapping")
    assert restored["took"] and overlapping["took"]
    pages = (512 << 10) // 4096
    assert restored["faults"] >= 100 * pages  # glibc's 128 KiB thresholds again: every chunk faults its pages in
    assert overlapping["faults"] <= 10 * pages  # still held by the run that goes on

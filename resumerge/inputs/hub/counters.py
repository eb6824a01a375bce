"""The figures of hub transfers, in a module of their own: what a run's range reads count (:class:`FetchCounters`:
every run keeps them, a local run's stay at zero) and the piece a download writes at a time (:data:`DOWNLOAD_CHUNK`:
``estimate`` times its disk at that size). Only a command that transfers imports the HTTP client that fills them
(:mod:`.ranges`, :mod:`.download`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

# The pieces a download writes to its file (:mod:`.download`). huggingface_hub gathers 10 MiB ones through an
# in-memory buffer: fresh memory for every piece, which the kernel faults in and zeroes. Measured on the project's
# 2-core VM, the CPU of a process downloading 400 MB: 3.8-4.1 s with 10 MiB pieces (a stream was paced near 50 MB/s by
# its own CPU, not by the link), 2.2-2.5 s with 1 MiB, 1.9-2.1 s with 256 KiB, about the same with 64 KiB
# (bench/RESULTS.md, session 12). ``http_get`` takes no chunk size and reads huggingface_hub's process-wide constant,
# which is why the body is read there, in pieces of this size, and no library setting is changed.
DOWNLOAD_CHUNK = 256 * 1024


@dataclass
class FetchCounters:
    """Bytes and requests of one source, shared by its threads (read under ``lock``)."""

    body_bytes: int = 0  # bytes received, including any a server sent past a range (counted, never used)
    requests: int = 0
    refreshed_urls: int = 0
    retries: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()

    def add(self, *, body: int = 0, requests: int = 0, refreshed: int = 0, retries: int = 0) -> None:
        """Add to the counters (thread-safe)."""
        with self.lock:
            self.body_bytes += body
            self.requests += requests
            self.refreshed_urls += refreshed
            self.retries += retries

"""What a run's range reads of the hub count (:class:`FetchCounters`), in a module of its own: every run keeps
them (a local run's stay at zero), and only a run that streams imports the HTTP client that fills them
(:mod:`.ranges`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


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

"""A scripted :class:`~resumerge.machine.memory.probe.MemoryProbe` for tests: memory figures are whatever you set."""

from __future__ import annotations

import threading

__all__ = ["FakeProbe"]


class FakeProbe:
    """A probe whose readings are plain attributes, set by the test (thread-safe).

    ``set(rss=..., available=...)`` changes readings atomically; ``reclaim()`` counts calls and, when
    ``reclaim_to`` is set, drops ``rss`` to it, as a successful ``malloc_trim`` would.
    """

    def __init__(
        self,
        *,
        rss: int = 0,
        available: int = 2**40,
        limit: int | None = None,
        reclaim_to: int | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._rss = rss
        self._available = available
        self._limit = limit
        self.reclaim_to = reclaim_to
        self.reclaim_calls = 0

    def set(self, *, rss: int | None = None, available: int | None = None) -> None:
        """Change the readings the next calls return; ``None`` leaves a reading as it was."""
        with self._lock:
            if rss is not None:
                self._rss = rss
            if available is not None:
                self._available = available

    def rss(self) -> int:
        """The scripted resident bytes."""
        with self._lock:
            return self._rss

    def available(self) -> int:
        """The scripted available bytes."""
        with self._lock:
            return self._available

    def limit(self) -> int | None:
        """The scripted ceiling."""
        return self._limit

    def reclaim(self) -> None:
        """Count the call; drop ``rss`` to ``reclaim_to`` when one is set."""
        with self._lock:
            self.reclaim_calls += 1
            if self.reclaim_to is not None:
                self._rss = min(self._rss, self.reclaim_to)

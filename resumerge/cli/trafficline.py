"""The network line under the live bars and in plain progress lines: both directions' rates over a short window,
bytes fetched and committed, and the network's time left (text only; :mod:`.render` draws it)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from resumerge.machine.memory.sizes import format_duration, format_size

if TYPE_CHECKING:
    from resumerge.merge.engine.traffic import Traffic


class TrafficRates:
    """Rates down and up over the last ``window`` seconds of the snapshots it is given (since the first one while
    the window is young)."""

    def __init__(self, window: float = 5.0) -> None:
        self._window = window
        self._samples: deque[tuple[float, int, int]] = deque()

    def add(self, when: float, now: Traffic) -> tuple[float | None, float | None]:
        """Record ``now`` at ``when``; return (bytes per second down, up), None before two samples."""
        samples = self._samples
        samples.append((when, now.fetched, now.uploaded))
        while len(samples) > 2 and when - samples[1][0] >= self._window:
            samples.popleft()
        first = samples[0]
        elapsed = when - first[0]
        if elapsed <= 0:
            return None, None
        return (now.fetched - first[1]) / elapsed, (now.uploaded - first[2]) / elapsed


def traffic_line(now: Traffic, down: float | None, up: float | None) -> str | None:
    """``network: down … MB/s, … of … fetched; up … MB/s, … of … committed; about … left`` (None when the run
    uses no network)."""
    if not now.active:
        return None
    parts: list[str] = []
    left: list[float | None] = []  # seconds each unfinished direction still needs (None: no rate yet)

    def direction(name: str, rate: float | None, done: int, total: int, verb: str) -> None:
        speed = f" {format_size(int(rate))}/s," if rate is not None else ""
        of = f" of {format_size(total)}" if total else ""
        parts.append(f"{name}{speed} {format_size(done)}{of} {verb}")
        if total > done:
            left.append((total - done) / rate if rate else None)

    if now.to_fetch or now.fetched:
        direction("down", down, now.fetched, now.to_fetch, "fetched")
    if now.to_commit or now.uploaded:
        direction("up", up, now.committed, now.to_commit, "committed")
    known = [seconds for seconds in left if seconds is not None]
    eta = f"; about {format_duration(max(known))} left" if known and len(known) == len(left) else ""
    return "network: " + "; ".join(parts) + eta

"""Progress and notice events the hub layer emits; rendering them is the caller's business."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["resolve", "pinned", "fallback", "download", "verify", "refetch"]


@dataclass(frozen=True)
class HubEvent:
    """One thing worth telling the user.

    ``kind``:
      - ``resolve``: a revision was resolved to ``commit`` (online lookup or the cache's ``refs/``);
      - ``pinned``: a pinned commit is used as-is (a resume), even if the branch has moved since;
      - ``fallback``: the hub could not be reached and the cache is used instead;
      - ``download``: bytes arrived for ``filename`` (``done`` of ``total``, ``rate`` in bytes/s);
      - ``verify``: ``filename`` is being hashed (``done`` of ``total`` bytes);
      - ``refetch``: a cached file failed verification and is fetched again.
    """

    kind: EventKind
    repo_id: str
    message: str
    filename: str | None = None
    commit: str | None = None
    done: int = 0
    total: int | None = None
    rate: float | None = None


ProgressCallback = Callable[[HubEvent], None]


def _ignore(event: HubEvent) -> None:
    return None


def callback_or_noop(on_progress: ProgressCallback | None) -> ProgressCallback:
    """Return ``on_progress`` or a callback that drops every event."""
    return on_progress if on_progress is not None else _ignore


class ByteMeter:
    """Turn a stream of byte counts into throttled ``download`` / ``verify`` events with a rate.

    At most one event every ``interval`` seconds, plus the final one from :meth:`finish`, so a fast local
    transfer does not flood the renderer.
    """

    def __init__(
        self,
        emit: ProgressCallback,
        kind: EventKind,
        repo_id: str,
        filename: str,
        *,
        done: int = 0,
        total: int | None = None,
        interval: float = 0.25,
    ) -> None:
        self._emit = emit
        self._kind: EventKind = kind
        self._repo_id = repo_id
        self._filename = filename
        self._total = total
        self._interval = interval
        self._start = time.monotonic()
        self._last = 0.0
        self._initial = done
        self.done = done
        self._sent: int | None = None  # the count of the last event sent

    def add(self, n: int) -> None:
        """Count ``n`` more bytes; emit an event if the interval has passed."""
        self.done += n
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            self._send(now)

    def restart(self, done: int) -> None:
        """Reset the counter after the server made the transfer start over at ``done`` bytes."""
        self.done = done
        self._initial = done
        self._start = time.monotonic()

    def finish(self) -> None:
        """Emit the final event for this file, unless the last one sent already had its count (a small file
        arrives in one chunk: its first event is its last, and the user would read it twice)."""
        if self._sent != self.done:
            self._send(time.monotonic())

    def _send(self, now: float) -> None:
        elapsed = now - self._start
        rate = (self.done - self._initial) / elapsed if elapsed > 0 else None
        verb = "downloading" if self._kind == "download" else "verifying"
        self._sent = self.done
        self._emit(
            HubEvent(
                self._kind,
                self._repo_id,
                f"{verb} {self._filename}",
                filename=self._filename,
                done=self.done,
                total=self._total,
                rate=rate,
            )
        )

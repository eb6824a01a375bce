"""The bytes a run moves over the network, both directions, for the progress display.

Down: input bytes received — downloads into the HF cache (their progress events, per file) and range reads of
streamed inputs (the sources' own counters). Up: output bytes whose upload finished, and those a commit holds (the
hub sink's counters). The engine builds one :class:`TrafficMeter` per run, points it at those counters and hands
:meth:`TrafficMeter.snapshot` to the reporter's optional ``traffic`` hook; the reporter reads it when it draws, so
the engine never calls it per byte and knows nothing of how it is drawn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resumerge.merge.engine.inputfetch import HubInputs
    from resumerge.merge.plan.merge_plan import Plan
    from resumerge.merge.store.sink import OutputSink


@dataclass(frozen=True)
class Traffic:
    """Cumulative bytes of one run so far; a total of 0 means "none expected" (or not known)."""

    fetched: int = 0
    to_fetch: int = 0
    uploaded: int = 0
    committed: int = 0
    to_commit: int = 0

    @property
    def active(self) -> bool:
        """Whether this run uses the network at all."""
        return bool(self.to_fetch or self.to_commit or self.fetched or self.uploaded)


class TrafficMeter:
    """Thread-safe counters of one run's network bytes, fed by the hub layers, read by the reporter."""

    def __init__(self, *, to_fetch: int = 0, to_commit: int = 0) -> None:
        self._lock = threading.Lock()
        self._to_fetch, self._to_commit = to_fetch, to_commit
        self._files: dict[str, int] = {}  # a download's bytes so far, by file
        self._fetch_sources: list[Callable[[], int]] = []
        self._upload_source: Callable[[], tuple[int, int]] | None = None

    def expect(self, *, fetch: int | None = None, commit: int | None = None) -> None:
        """Set the bytes this run is to fetch and to commit (what the ETA counts down)."""
        with self._lock:
            if fetch is not None:
                self._to_fetch = fetch
            if commit is not None:
                self._to_commit = commit

    def file_progress(self, key: str, done: int) -> None:
        """A download of ``key`` has ``done`` bytes so far (a restarted download may go back)."""
        with self._lock:
            self._files[key] = done

    def watch_fetch(self, read: Callable[[], int]) -> None:
        """Also count ``read()``, a cumulative count of input bytes received (streamed range reads)."""
        with self._lock:
            self._fetch_sources.append(read)

    def watch_uploads(self, read: Callable[[], tuple[int, int]]) -> None:
        """Count ``read()`` as (bytes uploaded, bytes committed) of the output."""
        with self._lock:
            self._upload_source = read

    def snapshot(self) -> Traffic:
        """The counts now."""
        with self._lock:
            files, sources, uploads = sum(self._files.values()), list(self._fetch_sources), self._upload_source
            to_fetch, to_commit = self._to_fetch, self._to_commit
        uploaded, committed = uploads() if uploads is not None else (0, 0)
        return Traffic(files + sum(read() for read in sources), to_fetch, uploaded, committed, to_commit)


def watch_run(meter: TrafficMeter, plan: Plan, hub: HubInputs | None, sink: OutputSink, done_bytes: int) -> bool:
    """Point ``meter`` at a run's counters: the hub inputs' range reads (downloads report through their progress
    events, :meth:`TrafficMeter.file_progress`) and an ``hf://`` sink's uploads; True when the run uses the
    network (then the reporter gets ``meter``)."""
    from resumerge.merge.plan.fetching import STREAM
    from resumerge.merge.store.sink import LocalDirSink

    if hub is not None:
        counters = hub.counters

        def streamed() -> int:
            with counters.lock:
                return counters.body_bytes

        meter.watch_fetch(streamed)
        meter.expect(fetch=sum(c.fetch_bytes for c in hub.choices if c.how != STREAM) + hub.needed)
    if not isinstance(sink, LocalDirSink):  # a folder uploads nothing (and the hub's client is never imported for it)
        from resumerge.merge.store.hubsink import HubRepoSink

        if isinstance(sink, HubRepoSink):
            meter.watch_uploads(sink.transferred)
            meter.expect(commit=max(0, plan.total_bytes - done_bytes))
    return meter.snapshot().active

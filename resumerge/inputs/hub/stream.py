"""The input source of a hub model whose weight files are read by HTTP Range instead of downloaded.

Files the plan chose to download are read from the cache snapshot by ``pread`` like any local model; streamed
files go through one :class:`~resumerge.inputs.hub.ranges.RangeClient` each. Told the order in which the plan
will read (:meth:`HubStream.expect`), the source fetches a tensor together with the adjacent tensors that the
plan reads next, in one request split over a few parallel connections, and keeps the extra ones until they
are asked for. Those read-ahead bytes are held only when ``reserve`` grants them (the memory governor), so a
streamed byte counts against the budget like any other; without room, a tensor is fetched alone.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from resumerge.inputs.gguf.header import GgufHeader
from resumerge.inputs.safetensors_format import Header
from resumerge.inputs.source import InputSource, LocalFiles
from resumerge.inputs.tensorio import TensorReader
from resumerge.machine.torch_import import torch

# Grants ``nbytes`` of read-ahead and returns the callable that gives them back, or None when there is no room.
Reserve = Callable[[int], "Callable[[], None] | None"]
# Called with (file, start, end, bytes) for every streamed range as it arrives (the run's integrity record).
Check = Callable[[str, int, int, bytearray], None]



class Ranges(Protocol):
    """What a streamed file is read through: a :class:`~resumerge.inputs.hub.ranges.RangeClient`, or one behind a
    node's fetch cache (:class:`~resumerge.inputs.hub.fetchcache.CachedRanges`)."""

    def read(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of the file, or a resumerge error."""


class Prefetched:
    """A streamed file's client that serves the bytes ``[start, start + len(data))`` fetched already (those past a
    GGUF's header that its read by range brought along) from ``data``, and fetches only the rest: no byte is fetched
    twice. What it serves is checked as every streamed range is."""

    def __init__(self, client: Ranges, start: int, data: bytes) -> None:
        self.client, self.start, self.data = client, start, data

    def read(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of the file, or a resumerge error."""
        have = self.start + len(self.data)
        if start >= have or end <= self.start:
            return self.client.read(start, end)
        out = self.client.read(start, self.start) if start < self.start else bytearray()
        out += self.data[max(start, self.start) - self.start:min(end, have) - self.start]
        if end > have:
            out += self.client.read(have, end)
        return out


def prefetched(client: Ranges, header: Header | GgufHeader) -> Ranges:
    """``client``, behind the bytes a GGUF header's read by range fetched past the header (never fetched again)."""
    if isinstance(header, GgufHeader) and header.read_ahead:
        return Prefetched(client, len(header.raw), header.read_ahead)
    return client


@dataclass(frozen=True)
class StreamedReads:
    """How a model's streamed files are read outside a merge (``resumerge check``): through ``ranges``, one per
    file, shared by every reader of the model in the process (so a range kept after its first fetch serves them
    all), and with ``check`` told of every range read, whatever its origin (the run's integrity record)."""

    ranges: Mapping[str, Ranges]
    check: Check | None = None


DEFAULT_COALESCE = 32 * 1024 * 1024
DEFAULT_CONNECTIONS = 4
_MIN_PART = 1024 * 1024


@dataclass
class _Run:
    """One coalesced request: its members not yet handed out, and the read-ahead they hold."""

    pending: int
    release: Callable[[], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _File:
    """Read-ahead state of one streamed file (guarded by :attr:`HubStream._lock`)."""

    def __init__(self, client: Ranges) -> None:
        self.client = client
        self.order: list[tuple[int, int]] = []
        self.position: dict[tuple[int, int], int] = {}
        self.buffer: dict[tuple[int, int], bytearray] = {}
        self.runs: dict[tuple[int, int], _Run] = {}  # member range -> the run fetching or holding it
        self.taken: set[tuple[int, int]] = set()


class HubStream(InputSource):
    """A hub model: ``streamed`` files by range, every other file from ``directory`` (its cache snapshot)."""

    def __init__(self, directory: str | Path, streamed: Mapping[str, Ranges], *,
                 reader: TensorReader | None = None, reserve: Reserve | None = None, check: Check | None = None,
                 coalesce_bytes: int = DEFAULT_COALESCE, connections: int = DEFAULT_CONNECTIONS) -> None:
        self._local = LocalFiles(directory, reader)
        self._files = {name: _File(client) for name, client in streamed.items()}
        self._reserve, self._check = reserve, check
        self._coalesce, self._connections = coalesce_bytes, max(1, connections)
        self._pool = ThreadPoolExecutor(max_workers=self._connections, thread_name_prefix="resumerge-range")
        self._lock = threading.Lock()

    def expect(self, order: Sequence[tuple[str, int, int]]) -> None:
        """Learn the ranges (file, start, end) the plan will read, in order; only streamed files keep them."""
        with self._lock:
            for state in self._files.values():
                state.order.clear()
                state.position.clear()
            for name, start, end in order:
                streamed = self._files.get(name)
                if streamed is not None and (start, end) not in streamed.position:
                    streamed.position[(start, end)] = len(streamed.order)
                    streamed.order.append((start, end))

    def rereads_cheaply(self, file: str) -> bool:
        return file not in self._files  # a streamed file is fetched again by every read

    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        state = self._files.get(file)
        if state is None:
            return self._local.read_range(file, start, end)
        data = self._take(file, state, (start, end))
        return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def _take(self, file: str, state: _File, key: tuple[int, int]) -> bytearray:
        """The bytes of ``key``: from the read-ahead buffer, from a run in flight, or fetched now."""
        members: list[tuple[int, int]] | None = None
        with self._lock:
            run = state.runs.get(key)
            if run is None:
                members = self._members(state, key)
                extra = sum(e - s for s, e in members[1:])
                release = self._reserve(extra) if extra and self._reserve is not None else None
                if release is None:
                    members = [key]  # no room for read-ahead: this tensor alone
                run = _Run(pending=len(members), release=release)
                for member in members:
                    state.runs[member] = run
        if members is not None:
            self._fetch(file, state, members, run)
        else:
            run.done.wait()
        if run.error is not None:
            raise run.error
        with self._lock:
            data = state.buffer.pop(key, None)
            if data is not None:
                state.runs.pop(key, None)
                state.taken.add(key)
                self._handed_out(run)
        if data is None:  # the same range read twice at once (a self-stack): the other reader took the copy
            data = state.client.read(*key)
            if self._check is not None:
                self._check(file, key[0], key[1], data)
        return data

    def _members(self, state: _File, key: tuple[int, int]) -> list[tuple[int, int]]:
        """``key`` and the adjacent ranges the plan reads right after it (not yet read, held or in flight),
        up to the coalescing limit."""
        members = [key]
        index = state.position.get(key)
        if index is None:
            return members  # not a planned read (a row chunk): fetched alone
        total, end = key[1] - key[0], key[1]
        for nxt in itertools.islice(state.order, index + 1, None):
            size = nxt[1] - nxt[0]
            if nxt[0] != end or nxt in state.taken or nxt in state.runs or total + size > self._coalesce:
                break
            members.append(nxt)
            total, end = total + size, nxt[1]
        return members

    def _fetch(self, file: str, state: _File, members: list[tuple[int, int]], run: _Run) -> None:
        """Fetch the span of ``members`` (in parallel parts), check each member and put it in the buffer."""
        first, last = members[0][0], members[-1][1]
        try:
            data = self._read_span(state.client, first, last)
            pieces = {m: data[m[0] - first: m[1] - first] for m in members}
            del data
            if self._check is not None:
                for (start, end), piece in pieces.items():
                    self._check(file, start, end, piece)
        except BaseException as exc:
            run.error = exc
            with self._lock:
                for member in members:
                    state.runs.pop(member, None)
                if run.release is not None:
                    run.release()
            run.done.set()
            raise
        with self._lock:
            state.buffer.update(pieces)
        run.done.set()

    def _read_span(self, client: Ranges, first: int, last: int) -> bytearray:
        length = last - first
        part = max(_MIN_PART, -(-length // self._connections))
        if length <= part:
            return client.read(first, last)
        bounds = [(s, min(last, s + part)) for s in range(first, last, part)]
        futures: list[Future[bytearray]] = [self._pool.submit(client.read, s, e) for s, e in bounds]
        data = bytearray()
        for future in futures:
            data += future.result()
        return data

    @staticmethod
    def _handed_out(run: _Run) -> None:
        run.pending -= 1
        if run.pending == 0 and run.release is not None:
            run.release()

    def close(self) -> None:
        """Drop the read-ahead (giving its memory back) and stop the connection threads."""
        self._pool.shutdown(wait=True)
        with self._lock:
            for state in self._files.values():
                for key in list(state.buffer):
                    del state.buffer[key]
                    run = state.runs.pop(key, None)
                    if run is not None:
                        self._handed_out(run)
        self._local.close()

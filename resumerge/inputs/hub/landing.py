"""Hub input files read while they download: the merge reads each byte as soon as it has landed in the cache.

A weight file chosen for download is fetched whole into the Hugging Face cache, as before, so a later run of the
same inputs fetches nothing; but the merge no longer waits for every download to finish. :class:`Landing` follows
one file's download (the bytes written and flushed so far to ``blobs/<etag>.resumerge.incomplete``, appended in
file order) and :class:`LandingFiles` serves a range once the download has passed its end, by ``pread`` on a
duplicate descriptor of that file, which stays valid when the finished file is renamed into ``blobs/``.

Bytes read early are not yet checked: the download is hashed as it arrives and compared with the hub's checksum
at its end, as every download is, and its header then compared with the one the merge was planned from
(:mod:`~resumerge.inputs.hub.headercheck`). :meth:`Landing.checked` says when that happened; the engine commits no
output file before every input file it read from is checked (a folder OUT: it is not published before; an hf://
OUT: it is uploaded at once, committed after), so nothing computed from unchecked bytes is ever committed. A
download whose bytes were read and that then fails its check, or restarts from zero (a server that ignored
``Range``), fails the run (exit 3, nothing of it committed): the resume fetches the file again. A verified download
whose header is not the planned one fails it with exit 4 (running the command again plans from the verified file).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from resumerge.inputs.hub.cache import RepoCache
from resumerge.inputs.hub.events import ProgressCallback, callback_or_noop
from resumerge.inputs.hub.fetch import land_file
from resumerge.inputs.hub.records import VerifyRecords
from resumerge.inputs.hub.remote import HubUnavailableError
from resumerge.inputs.hub.resolve import RepoMetadata
from resumerge.inputs.source import InputSource
from resumerge.inputs.tensorio import TORCH_DTYPES
from resumerge.inputs.torch_bin import is_pickle_checkpoint
from resumerge.machine.torch_import import torch


class DownloadCancelled(BaseException):
    """Raised inside a download whose run is closing; a BaseException so no retry or error mapping takes it."""


class Landing:
    """The landed bytes of one file being downloaded, shared by the download thread and the readers.

    The download calls :meth:`opened`, :meth:`grew`, :meth:`rewound`, then :meth:`finished` or :meth:`failed`;
    readers call :meth:`read` and :meth:`checked`.
    """

    def __init__(self, where: str, size: int) -> None:
        self.where, self.size = where, size
        self._cond = threading.Condition()
        self._fd = -1
        self.available = 0
        self.verified = False
        self.error: BaseException | None = None
        self.consumed = False  # bytes of the current attempt were handed to the merge
        self.cancelled = False
        # The merge read from an attempt that began with bytes read at plan time and failed its checksum: the file
        # is fetched again whole for the cache, unfollowed, and this landing then fails (see :meth:`before_retry`).
        self.detached = False
        # Run once, without the lock, when a reader must wait for a file whose download has not started
        # (:meth:`Downloads.wanted`): the download then starts at once instead of in its turn.
        self.on_wait: Callable[[], None] | None = None

    # ---- the download's side ---------------------------------------------------------------------------------
    def opened(self, fileno: int, have: int) -> None:
        """The partial file is open (``have`` bytes from an earlier run already in it): readers may use it."""
        with self._cond:
            self._check_cancelled()
            if self.detached:
                return
            self._close_fd()
            self._fd = os.dup(fileno)
            self.available = have
            self._cond.notify_all()

    def grew(self, size: int) -> None:
        """``size`` bytes are written and flushed; raises :class:`DownloadCancelled` when the run is leaving."""
        with self._cond:
            self._check_cancelled()
            if self.detached:
                return
            self.available = size
            self._cond.notify_all()

    def rewound(self, size: int) -> None:
        """The download starts over from ``size`` bytes: bytes already read may be rewritten, so the run fails."""
        with self._cond:
            if self.detached:
                return
            if self.consumed and size < self.available:
                self.error = self.error or HubUnavailableError(
                    f"the download of {self.where} restarted after the merge read from it; nothing merged from it "
                    "was committed", hint="run resumerge resume OUT: the file is fetched again")
            self.available = min(self.available, size)
            self._cond.notify_all()

    def before_retry(self, seeded: bool = False) -> None:
        """The download failed its checksum and is to be fetched again: harmless when nothing was read from it;
        otherwise the landing fails with the error raised here (the resume fetches the file again).

        ``seeded``: the attempt began with the bytes read when the run was planned (its header), which may be what
        differs from the file. Then, if the merge read from it, nothing is raised yet: the file is fetched again
        whole into the cache with this landing detached (readers get no byte of it), so that the header check can
        name a header other than the file's (the next run plans from the verified copy), and :meth:`finished` fails
        the landing if that check passes."""
        with self._cond:
            if self.consumed and seeded:
                self.detached = True
                return
            if self.consumed:
                self.error = self.error or HubUnavailableError(
                    f"{self.where}: the downloaded bytes fail the hub's checksum; nothing merged from them was "
                    "committed", hint="run resumerge resume OUT: the file is fetched again")
                self._cond.notify_all()
                raise self.error
            self.available = 0

    def finished(self, path: Path) -> None:
        """The file is complete and checked, at ``path`` (its cache snapshot entry)."""
        with self._cond:
            if self.detached:
                self.error = self.error or HubUnavailableError(
                    f"{self.where}: the downloaded bytes the merge read fail the hub's checksum; nothing merged from "
                    "them was committed", hint="run resumerge resume OUT: the file, since downloaded whole and "
                                               "verified, is read from the hub cache")
                self._cond.notify_all()
                return
            if self._fd < 0 and not self.cancelled:  # another process had downloaded it: read the cached file
                self._fd = os.open(path, os.O_RDONLY)
            self.available, self.verified = self.size, True
            self._cond.notify_all()

    def failed(self, error: BaseException) -> None:
        """The download stopped for good with ``error`` (readers and the publication gate raise it)."""
        with self._cond:
            self.error = self.error or error
            self._cond.notify_all()

    def cancel(self) -> None:
        """The run is leaving: the download stops at its next chunk (its partial file is kept for the next run)."""
        with self._cond:
            self.cancelled = True
            self._cond.notify_all()

    # ---- the readers' side -----------------------------------------------------------------------------------
    def read(self, start: int, end: int) -> torch.Tensor:
        """Bytes ``[start, end)`` once landed, as a fresh uint8 tensor; raises the download's error."""
        self.want(end)
        with self._cond:
            while self.error is None and not self.cancelled and self.available < end:
                self._cond.wait(timeout=1.0)
            self._raise()
            if self.cancelled and self.available < end:
                raise HubUnavailableError(f"{self.where}: the run stopped before these bytes landed")
            if self._fd < 0:
                raise HubUnavailableError(f"{self.where}: the run stopped before these bytes landed")
            self.consumed = True
            fd = os.dup(self._fd)  # the download may reopen its file meanwhile: read through our own descriptor
        try:
            buf = torch.empty(end - start, dtype=torch.uint8)
            view = buf.numpy().data
            done = 0
            while done < end - start:
                n = os.preadv(fd, [view[done:]], start + done)
                if n <= 0:
                    raise HubUnavailableError(f"{self.where} ended early while reading the landed bytes")
                done += n
            return buf
        finally:
            os.close(fd)

    def want(self, end: int) -> None:
        """A reader needs the bytes up to ``end``: if they have not landed, run :attr:`on_wait` (once)."""
        with self._cond:
            wake, self.on_wait = (self.on_wait, None) if self.available < end else (None, self.on_wait)
        if wake is not None:
            wake()

    def checked(self, timeout: float) -> bool:
        """Whether the whole file landed and matched the hub's checksum, waiting up to ``timeout`` seconds;
        raises the download's error."""
        with self._cond:
            if not self.verified and self.error is None:
                self._cond.wait(timeout=timeout)
            self._raise()
            return self.verified

    def close(self) -> None:
        with self._cond:
            self.cancelled = True
            self._close_fd()
            self._cond.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _check_cancelled(self) -> None:
        if self.cancelled:
            raise DownloadCancelled()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LandingFiles(InputSource):
    """A hub model whose ``landing`` files are read as they download; its other files come from ``inner`` (the
    cache snapshot, or HTTP Range for streamed ones)."""

    def __init__(self, inner: InputSource, landing: dict[str, Landing]) -> None:
        self._inner, self._landing = inner, landing

    def read_range(self, file: str, start: int, end: int) -> torch.Tensor:
        landing = self._landing.get(file)
        if landing is None:
            return self._inner.read_range(file, start, end)
        if is_pickle_checkpoint(file):  # read by virtual offsets through its pickle: only once complete
            landing.want(landing.size)
            while not landing.checked(1.0):
                pass
            return self._inner.read_range(file, start, end)
        return landing.read(start, end)

    def read_tensor(self, file: str, start: int, end: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        if file not in self._landing or is_pickle_checkpoint(file):
            return self._inner.read_tensor(file, start, end, dtype, shape)
        if end == start:
            return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        return self.read_range(file, start, end).view(TORCH_DTYPES[dtype]).reshape(shape)

    def rereads_cheaply(self, file: str) -> bool:
        return file in self._landing or self._inner.rereads_cheaply(file)

    def expect(self, order: Sequence[tuple[str, int, int]]) -> None:
        self._inner.expect(order)

    def checked(self, file: str, timeout: float) -> bool:
        landing = self._landing.get(file)
        return landing is None or landing.checked(timeout)

    def stop(self) -> None:
        for landing in self._landing.values():
            landing.cancel()
        self._inner.stop()

    def close(self) -> None:
        for landing in self._landing.values():
            landing.close()
        self._inner.close()


class Downloads:
    """The downloads of one run: each file into the hub cache, in the order the plan first reads them, a few at a
    time on daemon threads (a stopped run never waits for a transfer; its partial files are continued next time).

    A file the merge waits for before its turn starts at once on a thread of its own (:meth:`wanted`): an output
    shard often reads the end of one input file and the start of the next (the output's tensor order is not the
    inputs'), and fetching those two together lets it be merged, and its upload start, before the first file's
    whole tail has landed. Once such a download ends, no new one starts until fewer than ``workers`` run, so the
    link is split between more files only while the merge needs them.

    A wanted file's download is started by a thread of this object's own (:meth:`start`'s caller's priority), not
    by the waiting reader: a thread takes its creator's scheduling priority, and the engine's compute threads lower
    theirs in a run whose transfers go first (``resumerge.merge.engine.cpupriority``).

    ``jobs`` are (model key, metadata, file); :attr:`landings` follow them by (model key, file).
    """

    def __init__(self, jobs: list[tuple[str, RepoMetadata, str]], *, records_dir: Path,
                 on_progress: ProgressCallback | None = None, workers: int = 2) -> None:
        self._jobs = {(key, file): meta for key, meta, file in jobs}
        self.landings = {(key, file): Landing(f"{meta.repo_id}@{meta.commit[:12]}/{file}", meta.files[file].size
                                              or 0) for key, meta, file in jobs}
        self._records_dir, self._emit = records_dir, callback_or_noop(on_progress)
        self._workers = max(1, workers)
        self._queue: deque[tuple[str, str]] = deque()
        self._lock = threading.Lock()
        self._running = 0  # downloads in progress (guarded by _lock)
        self._threads: list[threading.Thread] = []
        self.started: list[tuple[str, str]] = []  # in the order their downloads began
        self._wanted: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()  # for _start_wanted

    def start(self, order: Sequence[tuple[str, str]]) -> None:
        """Start downloading, files in ``order`` (model key, file) first, then any others."""
        first = [k for k in dict.fromkeys(order) if k in self._jobs]
        self._queue.extend(first + [k for k in self._jobs if k not in set(first)])
        for key in self._queue:
            self.landings[key].on_wait = functools.partial(self.wanted, key)
        with self._lock:
            keys = [self._take() for _ in range(min(self._workers, len(self._queue)))]
        for key in keys:
            self._spawn(key)
        starter = threading.Thread(target=self._start_wanted, name="resumerge-download-starter", daemon=True)
        starter.start()

    def wanted(self, key: tuple[str, str]) -> None:
        """The merge waits for ``key``: start its download now if it is still queued."""
        with self._lock:
            if key not in self._queue:
                return
            self._queue.remove(key)
            self._running += 1
            self.started.append(key)
            self._wanted.put(key)  # under the lock: _start_wanted leaves only when none can come

    def _start_wanted(self) -> None:
        """Start the downloads :meth:`wanted` asks for, on threads of :meth:`start`'s caller's priority; ends once no
        queued file is left to ask for, or the run's sources are closed (every landing cancelled)."""
        while True:
            try:
                key = self._wanted.get(timeout=0.5)
            except queue.Empty:
                with self._lock:
                    if self._wanted.empty() and (not self._queue or all(ld.cancelled for ld in self.landings.values())):
                        return
                continue
            if key is None:
                return
            self._spawn(key)

    def _take(self) -> tuple[str, str]:
        """The next queued file, counted as running (under ``_lock``, the queue not empty)."""
        key = self._queue.popleft()
        self._running += 1
        self.started.append(key)
        return key

    def _spawn(self, key: tuple[str, str]) -> None:
        thread = threading.Thread(target=self._work, args=(key,), name="resumerge-download", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _work(self, first: tuple[str, str]) -> None:
        key: tuple[str, str] | None = first
        with VerifyRecords(self._records_dir) as records:
            while key is not None:
                if not self._land(key, records):
                    return
                with self._lock:
                    self._running -= 1
                    key = self._take() if self._queue and self._running < self._workers else None

    def _land(self, key: tuple[str, str], records: VerifyRecords) -> bool:
        """Download ``key`` (its landing follows); False when the run is leaving."""
        meta, landing = self._jobs[key], self.landings[key]
        if landing.cancelled:
            return False
        try:
            land_file(meta.settings, RepoCache(meta.settings.cache_dir, meta.repo_id), meta.commit,
                      meta.files[key[1]], records, self._emit, landing, meta.headers.get(key[1]))
        except DownloadCancelled:
            return False
        except BaseException as exc:  # the readers and the publication gate raise it
            landing.failed(exc)
        return True

    def close(self) -> None:
        """Stop the downloads at their next chunk and release the landed files' descriptors."""
        self._wanted.put(None)
        for landing in self.landings.values():
            landing.close()
        for thread in list(self._threads):
            thread.join(timeout=0.5)

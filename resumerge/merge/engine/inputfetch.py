"""Fetch what a plan needs from its hub inputs and open the sources the engine reads through.

For each hub weight file the plan reads, :func:`~resumerge.merge.plan.fetching.choose_fetch` decides: files already in
the cache are verified there; files to download are downloaded into the cache while the merge runs, in the order
the plan first reads them, and read as their bytes land (:mod:`resumerge.inputs.hub.landing`; the engine commits
no output file before the input files it read are checked); the rest are streamed by HTTP Range through a
:class:`~resumerge.inputs.hub.stream.HubStream`, whose read-ahead the memory governor grants. Local inputs are read
as they are.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from resumerge.config.locations import StateDir
from resumerge.errors import ResumergeError, UsageError
from resumerge.inputs.catalog import Inputs
from resumerge.inputs.hub.counters import FetchCounters
from resumerge.inputs.hub.integrity import StreamHashes
from resumerge.inputs.source import InputSource, InputSources, LocalFiles
from resumerge.inputs.tensorio import TensorReader
from resumerge.machine.memory import MemoryGovernor, format_size
from resumerge.merge.engine.executor import Reporter
from resumerge.merge.plan.fetching import CACHED, DOWNLOAD, STREAM, FileFetch, choose_fetch, first_reads, needed_ranges
from resumerge.merge.plan.merge_plan import Plan
from resumerge.merge.store.ledger import Ledger

if TYPE_CHECKING:  # the hub's client stack is imported where a run has hub inputs (HubInputs.open), never else
    from resumerge.inputs.gguf.header import GgufHeader
    from resumerge.inputs.hub import ProgressCallback
    from resumerge.inputs.hub.integrity import FileDigest
    from resumerge.inputs.hub.landing import Downloads
    from resumerge.inputs.hub.ranges import StreamedFile
    from resumerge.inputs.hub.stream import Check
    from resumerge.inputs.safetensors_format import Header


def plan_fetch(plan: Plan, inputs: Inputs, *, max_disk: int | None = None,
               done: Iterable[str] = ()) -> tuple[FileFetch, ...]:
    """The fetch choice of every hub weight file ``plan`` reads (``--stream-inputs`` from ``plan.options``);
    a file is ``cached`` when its snapshot entry exists (it is still verified before use).

    Under ``max_disk`` (``--max-disk``, which also bounds the output's staged files) downloads may use what is
    left once what the hub inputs' cache folders hold already and the largest output shard (the least the output
    needs on local disk) have room.
    """
    if not inputs.hub:
        return ()  # only hub files are fetched: no need to walk a 92k-tensor plan's reads for local inputs
    cached = [(key, f) for key, meta in inputs.hub.items() for f in meta.weight_files
              if (meta.snapshot_dir / f).exists()]
    budget = None if max_disk is None else max(0, max_disk - _largest_shard(plan) - _small_bytes(inputs))
    return choose_fetch(plan, inputs.hub, stream=plan.options.stream_inputs, max_disk=budget,
                        cached=cached, done=done)


PROGRESS_SECONDS = 5.0


def _check_room(plan: Plan, max_disk: int | None, disk_bytes: int) -> None:
    """Raise :class:`UsageError` (exit 2) when ``max_disk`` less the inputs' ``disk_bytes`` cannot hold the
    largest output shard."""
    largest = _largest_shard(plan)
    if max_disk is None or not disk_bytes or max_disk - disk_bytes >= largest:
        return
    raise UsageError(
        f"--max-disk {format_size(max_disk)} leaves {format_size(max(0, max_disk - disk_bytes))} for the output "
        f"once the hub inputs kept on disk ({format_size(disk_bytes)}) are counted, less than the largest output "
        f"shard ({format_size(largest)})",
        hint="pass --stream-inputs, a larger --max-disk, or a smaller --out-shard-size")


def _largest_shard(plan: Plan) -> int:
    return max((s.file_size for s in plan.shards), default=0)


def _small_bytes(inputs: Inputs) -> int:
    """Bytes the hub inputs' cache folders hold now (blobs, file lists, refs; links not counted twice)."""
    from resumerge.inputs.hub.cache import RepoCache

    roots = {RepoCache(meta.settings.cache_dir, meta.repo_id).root for meta in inputs.hub.values()}
    return sum(p.stat().st_size for root in roots for p in root.rglob("*") if p.is_file() and not p.is_symlink())


class HubInputs:
    """The inputs of one run once fetched: per-file choices, the sources, and the streamed-byte counters.

    :meth:`open` downloads what is to be downloaded (before the run takes OUT's lock, as always);
    :meth:`attach` binds the run's ledger, which records each streamed tensor's hash, and returns the sources.
    """

    def __init__(self, plan: Plan, choices: tuple[FileFetch, ...], sources: InputSources, counters: FetchCounters,
                 hashes: StreamHashes, downloads: Downloads | None = None) -> None:
        self.choices, self.counters, self.downloads = choices, counters, downloads
        self._plan, self._sources, self._hashes = plan, sources, hashes
        self._streamed = {(c.model, c.file) for c in choices if c.how == STREAM}
        self.needed = sum(c.needed for c in choices if c.how == STREAM)
        self._ledger: Ledger | None = None
        self._reporter: Reporter | None = None
        self._started = self._last = time.monotonic()
        self._lock = threading.Lock()
        self.disk_bytes = 0  # hub input bytes kept on local disk by this run (set by open)
        self._headers: dict[tuple[str, str], tuple[str, Header | GgufHeader]] = {}
        self.remote: tuple[StreamedFile, ...] = ()  # the streamed files, as another machine finds them (set by open)

    @classmethod
    def open(
        cls,
        plan: Plan,
        inputs: Inputs,
        *,
        state: StateDir,
        on_progress: ProgressCallback | None = None,
        governor: MemoryGovernor | None = None,
        max_disk: int | None = None,
    ) -> HubInputs:
        """Choose per file, verify the cached files, check that the downloads can happen (offline mode, free
        space) and open every input's source; downloads start with :meth:`attach`.

        Raises what :func:`~resumerge.inputs.hub.fetch_weights` raises for cached files and refused downloads;
        downloaded and streamed files are first read when the engine asks for them.
        """
        counters, hashes = FetchCounters(), StreamHashes()
        reader = TensorReader()
        if not inputs.hub:  # local inputs alone, read as they are: nothing to fetch, no hub client imported
            local: dict[str, InputSource] = {key: LocalFiles(d, reader) for key, d in plan.model_dirs.items()}
            inputs_ = cls(plan, (), InputSources(local, shared=reader), counters, hashes)
            hashes.after = inputs_.tick
            return inputs_
        from resumerge.inputs.hub import fetch_weights
        from resumerge.inputs.hub.cache import RepoCache
        from resumerge.inputs.hub.fetch import check_downloads
        from resumerge.inputs.hub.landing import Downloads, LandingFiles
        from resumerge.inputs.hub.ranges import RangeClient, StreamedFile
        from resumerge.inputs.hub.stream import HubStream, prefetched

        choices = plan_fetch(plan, inputs, max_disk=max_disk)
        # What the inputs will keep on local disk, known before any download so a refusal costs nothing.
        disk_bytes = _small_bytes(inputs) + sum(c.size for c in choices if c.how == DOWNLOAD)
        _check_room(plan, max_disk, disk_bytes)
        sources: dict[str, InputSource] = {}
        jobs = []
        for key in plan.model_dirs:
            meta = inputs.hub.get(key)
            mine = [c for c in choices if c.model == key]
            cached = [c.file for c in mine if c.how == CACHED]
            if meta is not None and cached:
                fetch_weights(meta, cached, records_dir=state.records_dir, on_progress=on_progress)
            downloads = [c.file for c in mine if c.how == DOWNLOAD]
            if meta is not None and downloads:
                check_downloads(meta.settings, RepoCache(meta.settings.cache_dir, meta.repo_id), meta.commit,
                                [meta.files[f] for f in downloads])
                jobs += [(key, meta, f) for f in downloads]
        # One download per input model at a time: the plan reads the models in step, so their files are needed
        # together, and more at once would only split the link between files needed later. The exception is a
        # file the merge already waits for (Downloads.wanted): it starts at once beside the one in progress.
        landing = Downloads(jobs, records_dir=state.records_dir, on_progress=on_progress,
                            workers=min(4, len({key for key, _, _ in jobs}))) if jobs else None
        for key, directory in plan.model_dirs.items():
            meta = inputs.hub.get(key)
            mine = [c for c in choices if c.model == key]
            streamed = {c.file: prefetched(RangeClient(meta.settings, meta.repo_id, meta.commit, c.file, c.size,
                                                        counters=counters), meta.headers[c.file])
                        for c in mine if c.how == STREAM and meta is not None}
            inner: InputSource = LocalFiles(directory, reader) if not streamed else HubStream(
                directory, streamed, reader=reader, reserve=read_ahead_grants(governor), check=_bind(hashes, key),
                coalesce_bytes=coalesce_for(governor))
            arriving = {f: ld for (k, f), ld in landing.landings.items() if k == key} if landing else {}
            sources[key] = LandingFiles(inner, arriving) if arriving else inner
        inputs_ = cls(plan, choices, InputSources(sources, shared=reader), counters, hashes, landing)
        hashes.after = inputs_.tick
        inputs_.disk_bytes = disk_bytes
        inputs_.remote = tuple(StreamedFile(c.model, c.file, inputs.hub[c.model].repo_id, inputs.hub[c.model].commit,
                                            c.size, inputs.hub[c.model].settings.endpoint)
                               for c in choices if c.how == STREAM)
        inputs_._headers = {(c.model, c.file): (inputs.hub[c.model].repo_id, inputs.hub[c.model].headers[c.file])
                            for c in choices if c.how == STREAM}
        return inputs_

    @property
    def streams(self) -> bool:
        """Whether some file is read by HTTP Range (its threads start from a reader's)."""
        return bool(self._streamed)

    def output_budget(self, max_disk: int | None) -> int | None:
        """What ``max_disk`` leaves for the output's staged files once the hub inputs kept in the cache (their
        cache folders, downloads included) are counted; :meth:`open` refused a budget too small for that."""
        return None if max_disk is None else max_disk - self.disk_bytes

    def attach(self, ledger: Ledger, reporter: Reporter | None = None) -> InputSources:
        """The sources to read through, with streamed tensors checked against (and recorded in) ``ledger``;
        progress goes to ``reporter`` and, every few seconds, to the ledger (what ``status`` shows).

        What this run still needs is counted from the shards ``ledger`` has not committed (a resume needs less).
        """
        done = [r.name for r in ledger.files() if r.status == "done"]
        if self.downloads is not None:
            self.downloads.start(first_reads(self._plan, done))
        # Only streamed files are counted and checked whole: a run that streams none skips the plan-wide walk.
        needed = needed_ranges(self._plan, done) if self._streamed else {}
        self.needed = sum(e - s for key, spans in needed.items() if key in self._streamed for s, e in spans)
        self._hashes.digests = self._whole_files(needed, ledger)
        self._hashes.ledger, self._ledger, self._reporter = ledger, ledger, reporter
        self._started = self._last = time.monotonic()
        return self._sources

    def _whole_files(self, needed: dict[tuple[str, str], list[tuple[int, int]]],
                     ledger: Ledger) -> dict[tuple[str, str], FileDigest]:
        """A digest for every streamed file this run reads entirely (header bytes fed already)."""
        from resumerge.inputs.hub.integrity import whole_file_digest

        identities = {(key, f[0]): f[2] for key, files in self._plan.inputs.items() for f in files}
        digests = {}
        for key in self._streamed:
            repo_id, header = self._headers[key]
            where = f"{repo_id}/{key[1]}"

            def verified(ok: bool, where: str = where) -> None:
                if ok:
                    ledger.event("verify", f"{where}: every byte streamed, checksum matches the hub's")

            found = whole_file_digest(where, header, identities.get(key) or "", verified)
            if found is not None and needed.get(key) == found[0]:
                digests[key] = found[1]
        return digests

    def read_elsewhere(self, reads: Sequence[tuple[str, str, int, int, str]], fetched: int) -> None:
        """Ranges of streamed files that another machine (a cluster node) read, as (model, file, start, end,
        sha256): checked against (and recorded in) the ledger as this process's own reads are, and the ``fetched``
        bytes that machine took from the hub counted in this run's figures. Raises
        :class:`~resumerge.inputs.hub.integrity.StreamedInputChanged` on a mismatch."""
        for model, file, start, end, digest in reads:
            self._hashes.check_digest(model, file, start, end, digest)
        self.counters.add(body=fetched)
        self.tick()

    def figures(self) -> dict[str, float]:
        """Streamed bytes fetched by this process, bytes it needs, requests, the rate, refreshes and retries."""
        c = self.counters
        elapsed = max(1e-6, time.monotonic() - self._started)
        with c.lock:
            return {"fetched": c.body_bytes, "needed": self.needed, "requests": c.requests,
                    "rate": round(c.body_bytes / elapsed), "refreshed_urls": c.refreshed_urls, "retries": c.retries}

    def tick(self, *, force: bool = False) -> None:
        """Report progress (at most every :data:`PROGRESS_SECONDS`, or now with ``force``)."""
        if not self._streamed or self._ledger is None:
            return
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last < PROGRESS_SECONDS:
                return
            self._last = now
        f = self.figures()
        text = (f"streamed {format_size(int(f['fetched']))} of {format_size(int(f['needed']))} needed at "
                f"{format_size(int(f['rate']))}/s")
        self._ledger.event("stream", text, f)
        if self._reporter is not None:
            self._reporter.message(text)

    def record(self, ledger: Ledger) -> None:
        """Store the final streaming figures in the ledger (``status`` shows them); a ledger that cannot be
        written now must not hide the error that ended the run."""
        with contextlib.suppress(ResumergeError):
            self.tick(force=True)


def _bind(hashes: StreamHashes, key: str) -> Check:
    def check(file: str, start: int, end: int, data: bytearray) -> None:
        hashes.check(key, file, start, end, data)

    return check


def coalesce_for(governor: MemoryGovernor | None) -> int:
    """The most bytes one coalesced range request may span under ``governor``."""
    from resumerge.inputs.hub.stream import DEFAULT_COALESCE

    # Read-ahead is at most an eighth of the budget, so it never crowds out the units the governor admits.
    return DEFAULT_COALESCE if governor is None else max(1, min(DEFAULT_COALESCE, governor.work_budget // 8))


def read_ahead_grants(governor: MemoryGovernor | None) -> Callable[[int], Callable[[], None] | None] | None:
    """Read-ahead grants from ``governor``, never waiting: without room now, a tensor is fetched alone."""
    if governor is None:
        return None
    pool = governor

    def reserve(nbytes: int) -> Callable[[], None] | None:
        try:
            return pool.acquire(nbytes, timeout=0, what="read-ahead").release
        except (TimeoutError, UsageError):
            return None

    return reserve


"""A check's reads of hub weight files, held to the standard of a merge's streamed inputs: nothing from the hub is
trusted without a checksum.

A hub model's weights are read by HTTP Range (:mod:`.opened`). Every range read is checked as a merge checks its
streamed ranges (:class:`~resumerge.inputs.hub.integrity.StreamHashes`): its sha256 is recorded in the check's
journal (:data:`READS_NAME` in its workdir, a ledger's ``stream_reads``) when first read, and a later read of the
same range — a killed check resumed — must give the same bytes. A check that reads every byte of a file (its static
pass reads every tensor of every model: each weight file whole but its header and padding) verifies the file
against the hub's checksum (its LFS sha256) as the last byte arrives, the header it was planned from and a GGUF's
zero padding counted as known bytes (:func:`~resumerge.inputs.hub.integrity.whole_file_digest`), so before its
report is written. The static pass reads the tensors outside the decoder layers first, some at the end of their file
(a GGUF's head): what comes before its file's digest reaches it is kept on disk in the workdir (:data:`SPILL_NAME`)
past what a digest holds in memory, and deleted once hashed. Either mismatch stops the check with exit 4 naming
the file, and discards the check's journal: checked again, it starts over and reads (and verifies) every file whole.

Reading by range stays cheap: every reader of a model in the process (the static pass's, the forward pass's, the heads')
reads through one client per file (:class:`~resumerge.inputs.hub.stream.StreamedReads`), and the tensors read twice
(those outside the decoder layers: the static pass reads them first, then the forward pass and the heads; the merge's
first layer, which the pass runs once to learn whether it takes batches) are kept on local disk in the workdir
(:class:`~resumerge.inputs.hub.fetchcache.FetchCache`) after their first fetch, until the report is written: no byte is
fetched twice (a check on Ray, whose driver reads each byte once, keeps none). (Where the budget holds one layer at a
time, the static pass is not folded into the forward pass and reads the decoder layers too: those are fetched again by
the forward pass, as before.)
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from resumerge.forward.opening.opened import PassModel, layer_of
from resumerge.inputs.spans import merged_spans

if TYPE_CHECKING:  # the hub's modules and the ledger's writer are imported only for a hub model (a local check's
    # start is paid again by every check)
    from resumerge.inputs.hub.fetchcache import CachedRanges, FetchCache
    from resumerge.inputs.hub.integrity import StreamHashes
    from resumerge.inputs.hub.stream import Check, Ranges

READS_NAME = "hub-reads.db"
FETCHED_NAME = "fetched"
SPILL_NAME = "early"  # ranges read before their file's digest reached them, past what it holds in memory
_STOPPED = "the check stopped before its report, and its journal was discarded"
_HINT = "check again once the hub serves the file intact: the check starts over and reads every file whole again"


class ReadsJournal(Protocol):
    """The journal of a pass's hub reads, opened at a path: each range's sha256 recorded when first read (a
    :class:`~resumerge.inputs.hub.integrity.RangeRecord`), the events of the files verified whole, closed. The
    client hands in the merge's ledger class (:class:`~resumerge.merge.store.ledger.Ledger`: the file is a ledger,
    read by ``status`` as one), so its schema has one owner and this engine imports nothing of it."""

    def __init__(self, path: Path) -> None: ...

    def remember_read(self, model: str, file: str, start: int, end: int, sha256: str) -> str: ...

    def event(self, kind: str, message: str) -> None: ...

    def close(self) -> None: ...


class PassReads:
    """The hub files of one check's models, read through :meth:`bind`'s readers; :meth:`finish` before the report,
    :meth:`close` after it, :meth:`discard` when a file failed its check."""

    def __init__(self, workdir: Path, journal: type[ReadsJournal]) -> None:
        self.workdir, self._journal = workdir, journal
        self.hashes: StreamHashes | None = None
        self._ledger: ReadsJournal | None = None
        self._cache: FetchCache | None = None
        self._proved: set[tuple[str, str, int, int]] = set()  # ranges :meth:`elsewhere` read here

    def bind(self, models: Sequence[PassModel], *, fresh: bool, again: bool = True) -> list[PassModel]:
        """``models``, each hub model's files to be read through one reader each, checked; the others as they
        are. A ``fresh`` check (one that journaled none of its passes before: it reads every byte) verifies every
        file whole. ``again``: this process reads the tensors outside the decoder layers (and the merge's first
        layer) a second time, its forward pass running here, so they are kept on disk after their first fetch;
        without (``check --executor ray``, whose nodes run the forward pass), nothing is kept."""
        if not any(m.remote for m in models):
            return list(models)
        from resumerge.inputs.hub.fetchcache import FetchCache
        from resumerge.inputs.hub.integrity import StreamHashes

        self.workdir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.workdir / SPILL_NAME, ignore_errors=True)  # a killed run's: its digests died with it
        self.hashes = StreamHashes(changed=_STOPPED, hint="the hub served changed content for a pinned commit; "
                                                          "check again later: the check starts over")
        self._ledger = self.hashes.ledger = self._journal(self.workdir / READS_NAME)
        kept = [_kept(m, first=i == 0) if again else {} for i, m in enumerate(models)]
        self._cache = FetchCache(self.workdir / FETCHED_NAME, sum(e - s for spans in kept for file in spans.values()
                                                                   for s, e in file))
        return [self._bound(m, spans, fresh) if m.remote else m for m, spans in zip(models, kept)]

    def _bound(self, model: PassModel, kept: dict[str, list[tuple[int, int]]], fresh: bool) -> PassModel:
        from resumerge.inputs.hub.integrity import whole_file_digest
        from resumerge.inputs.hub.stream import StreamedReads, prefetched

        assert self._cache is not None and self.hashes is not None
        identities = {f.name: f.identity for f in model.opened.files}
        ranges: dict[str, Ranges] = {}
        for remote in model.remote:
            header = model.headers[remote.file]
            client = remote.client()
            spans = kept.get(remote.file, [])
            through: Ranges = KeptRanges(client, self._cache.reader(client), spans) if spans else client
            ranges[remote.file] = prefetched(through, header)
            if fresh:
                where = f"{remote.repo_id}/{remote.file}"
                found = whole_file_digest(where, header, identities.get(remote.file, ""), self._verified(where),
                                          stopped=_STOPPED, hint=_HINT, spill=self.workdir / SPILL_NAME)
                if found is not None:
                    self.hashes.digests.setdefault((model.path, remote.file), found[1])
        return replace(model, reads=StreamedReads(ranges, _bind(self.hashes, model.path)))

    def elsewhere(self, model: PassModel, reads: Sequence[tuple[str, int, int, str]], *, prove: bool = False
                  ) -> None:
        """Ranges of ``model``'s hub files that another process read (a Ray node's, ``--executor ray``), as (file,
        start, end, sha256): held to the journal as this process's own reads are. With ``prove`` (this process
        reads no other byte of them: ``measure --executor ray``), each range of a file to be verified whole is read
        here too, through ``model``'s bound reads, so that the file is proved against the hub's checksum as its
        last byte arrives, as where this process reads it all (a range seen twice is read once). Raises
        :class:`~resumerge.inputs.hub.integrity.StreamedInputChanged` on a mismatch."""
        if self.hashes is None:
            return
        for file, start, end, digest in reads:
            self.hashes.check_digest(model.path, file, start, end, digest)
            whole = self.hashes.digests.get((model.path, file))
            if prove and whole is not None and not whole.complete and model.reads is not None \
                    and (model.path, file, start, end) not in self._proved:
                self._proved.add((model.path, file, start, end))
                data = model.reads.ranges[file].read(start, end)
                if model.reads.check is not None:  # the node's digest compared, the file's fed
                    model.reads.check(file, start, end, data)

    def _verified(self, where: str) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            if ok and self._ledger is not None:
                self._ledger.event("verify", f"{where}: every byte read, checksum matches the hub's")

        return done

    def finish(self) -> list[str]:
        """Before the report: the files this run was to verify whole but did not (bytes no tensor covers), each
        noted in the journal; a mismatch was raised as its last byte came."""
        if self.hashes is None:
            return []
        unchecked = [d.where for d in self.hashes.digests.values() if not d.complete]
        if self._ledger is not None:
            for where in unchecked:
                self._ledger.event("unverified", f"{where}: not every byte was read; each range read is checked "
                                                 "against the check's journal only")
        return unchecked

    def close(self, *, clear: bool = True, error: BaseException | None = None) -> None:
        """Close the journal; with ``clear`` (the report is written: a check asked again reads nothing) delete the
        ranges kept for a second read too (without: a killed check resumed reads them from here). ``error``: what
        stopped the check: where a file failed its check, all is discarded (:meth:`discard`)."""
        if error is not None and self.hashes is not None:
            from resumerge.inputs.hub.integrity import StreamedInputChanged

            if isinstance(error, StreamedInputChanged):
                self.discard()
                return
        if self.hashes is not None:
            for digest in self.hashes.digests.values():
                digest.close()  # what a digest held of a check stopped before it was fed every byte
        if clear and self._cache is not None:
            self._cache.clear()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def discard(self) -> None:
        """A file failed its check: the whole journal goes (the figures found from the file with it), so a check
        asked again starts over and verifies every file whole."""
        self.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class KeptRanges:
    """One hub file's ranges, the ``kept`` spans (read more than once by the check) through ``cached`` (fetched once,
    then read from local disk), the rest straight from ``client``: a range is split at their edges."""

    def __init__(self, client: Ranges, cached: CachedRanges, kept: list[tuple[int, int]]) -> None:
        self.client, self.cached, self.kept = client, cached, kept

    def read(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of the file, or a resumerge error."""
        data = bytearray()
        at = start
        for first, last in self.kept:
            if last <= at:
                continue
            if first >= end:
                break
            if first > at:
                data += self.client.read(at, first)
                at = first
            stop = min(last, end)
            data += self.cached.read(at, stop)
            at = stop
        if at < end:
            data += self.client.read(at, end)
        return data


def _kept(model: PassModel, *, first: bool) -> dict[str, list[tuple[int, int]]]:
    """Per hub file of ``model``, the spans the check reads more than once (merged, by start): its tensors outside
    the decoder layers and, of the merge (``first``), its first layer's."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, found in model.opened.tensors.items():
        layer = layer_of(name)
        if found.entry.end > found.entry.start and (layer is None or (first and layer == 0)):
            spans.setdefault(found.file, []).append((found.entry.start, found.entry.end))
    return {file: merged_spans(listed) for file, listed in spans.items()}


def _bind(hashes: StreamHashes, key: str) -> Check:
    def check(file: str, start: int, end: int, data: bytearray) -> None:
        hashes.check(key, file, start, end, data)

    return check

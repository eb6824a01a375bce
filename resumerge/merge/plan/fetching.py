"""Decide, per hub input file, whether a merge downloads it whole or reads the bytes it needs by HTTP Range.

Pure functions of the plan: which byte ranges of each input file the plan reads (:func:`needed_ranges`), in
which order the engine reads them (:func:`read_order`, what lets a streamed source coalesce adjacent tensors),
and the choice itself (:func:`choose_fetch`). The choice changes no output byte, so it is not part of the
plan's fingerprint: a resume may choose differently (say, on a fresh machine with an empty cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from resumerge.inputs.spans import merged_spans
from resumerge.inputs.torch_bin import is_pickle_checkpoint
from resumerge.machine.memory.sizes import format_size
from resumerge.merge.plan.merge_plan import InputRef, Plan, ShardPlan
from resumerge.merge.plan.workorder import compute_order

DOWNLOAD, STREAM, CACHED = "download", "stream", "cached"


@dataclass(frozen=True)
class FileFetch:
    """How one weight file of a hub input is fetched: ``how`` is ``download`` (whole, into the HF cache),
    ``stream`` (``needed`` bytes by range, nothing on disk) or ``cached`` (already complete in the cache).

    ``fetch_bytes`` is what the choice costs on the network; ``reason`` says why, for ``plan``.
    """

    model: str
    file: str
    size: int
    needed: int
    how: str
    reason: str

    @property
    def fetch_bytes(self) -> int:
        """Bytes this choice fetches: the file for a download, the needed ranges for a stream, none if cached."""
        return {DOWNLOAD: self.size, STREAM: self.needed}.get(self.how, 0)


def _refs(plan: Plan, done: Iterable[str] = (), order: Sequence[ShardPlan] | None = None) -> Iterable[InputRef]:
    """Every input reference of the tensors of shards not in ``done``, in the engine's reading order (``order``:
    :func:`~resumerge.merge.plan.workorder.compute_order`'s, when the caller has it already)."""
    skip = set(done)
    for shard in compute_order(plan) if order is None else order:
        if shard.name in skip:
            continue
        for name in shard.tensors:
            yield from plan.tensors[name].reads()


def read_order(plan: Plan, done: Iterable[str] = (), *,
               order: Sequence[ShardPlan] | None = None) -> list[tuple[str, str, int, int]]:
    """(model, file, start, end) of every read of the shards not in ``done``, in the order they are computed
    (``order``: the shards' :func:`~resumerge.merge.plan.workorder.compute_order`, when the caller has it: a 90k-tensor
    plan's order costs the main thread about half a second)."""
    return [(r.model, r.file, r.start, r.end) for r in _refs(plan, done, order) if r.end > r.start]


def first_reads(plan: Plan, done: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Every (model, file) the shards not in ``done`` read, in the order the engine first reads from it: the order
    downloads run in, so the merge can start on the first files while the later ones arrive."""
    return list(dict.fromkeys((model, file) for model, file, _, _ in read_order(plan, done)))


def shard_input_files(plan: Plan, shard: ShardPlan) -> list[tuple[str, str]]:
    """The (model, file) pairs the tensors of ``shard`` read, sorted: what must be checked before it is published."""
    return sorted({(ref.model, ref.file) for name in shard.tensors for ref in plan.tensors[name].reads()})


def needed_ranges(plan: Plan, done: Iterable[str] = ()) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """The merged byte ranges of each (model, file) that the shards not in ``done`` read, sorted."""
    spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for model, file, start, end in read_order(plan, done):
        spans.setdefault((model, file), []).append((start, end))
    return {key: merged_spans(ranges) for key, ranges in spans.items()}


def choose_fetch(
    plan: Plan,
    hub_models: Iterable[str],
    *,
    stream: bool = False,
    max_disk: int | None = None,
    cached: Iterable[tuple[str, str]] = (),
    done: Iterable[str] = (),
) -> tuple[FileFetch, ...]:
    """The choice for every weight file of the ``hub_models`` (model keys) that the plan reads.

    Rule: a file already complete in the cache (``cached``) is read from it; ``stream`` (``--stream-inputs``)
    streams every other file; otherwise (``auto``) a file is streamed when the plan needs less than half of its
    bytes, or when downloading it would take the downloads of this merge past ``max_disk`` bytes (files are
    considered in plan order; ``None`` means no disk limit), and downloaded into the cache otherwise: the engine
    downloads in :func:`first_reads` order while it merges, each byte read once it has landed, so the download
    costs no wait beyond the link and a later run reads the cache. Files the plan does not read are left out.
    """
    hub, have = set(hub_models), set(cached)
    needed = needed_ranges(plan, done)
    on_disk = 0
    choices: list[FileFetch] = []
    for model in sorted(hub):
        for file, size, _identity in plan.inputs.get(model, ()):
            ranges = needed.get((model, file))
            if not ranges:
                continue
            need = sum(end - start for start, end in ranges)
            how, reason = _choose(size, need, (model, file) in have, stream and not is_pickle_checkpoint(file),
                                  max_disk, on_disk, whole=is_pickle_checkpoint(file))
            if how == DOWNLOAD:
                on_disk += size
            choices.append(FileFetch(model, file, size, need, how, reason))
    return tuple(choices)


def fetch_summary(choices: Iterable[FileFetch]) -> str | None:
    """One line for ``plan``: what the run's default fetch does with its hub input files (None: no hub input)."""
    by: dict[str, list[FileFetch]] = {}
    for c in choices:
        by.setdefault(c.how, []).append(c)
    if not by:
        return None

    def size(how: str) -> str:
        total = sum(c.fetch_bytes if how != CACHED else c.size for c in by[how])
        return f"{len(by[how])} file(s) ({format_size(total)})"

    parts = []
    if DOWNLOAD in by:
        parts.append(f"download {size(DOWNLOAD)} into the HF cache in the order the merge reads them, merging each "
                     "shard as its bytes land (a later run reads the cache)")
    if STREAM in by:
        parts.append(f"stream {size(STREAM)} by HTTP Range (nothing kept on disk)")
    if CACHED in by:
        parts.append(f"read {size(CACHED)} from the HF cache")
    return "; ".join(parts)


def _choose(size: int, need: int, cached: bool, stream: bool, max_disk: int | None,
            on_disk: int, *, whole: bool = False) -> tuple[str, str]:
    if cached:
        return CACHED, "complete in the hub cache"
    if whole:  # a .bin is addressed by virtual offsets (resumerge.inputs.torch_bin): never by HTTP Range
        return DOWNLOAD, "a .bin checkpoint is read whole"
    if stream:
        return STREAM, "--stream-inputs"
    if 2 * need < size:
        return STREAM, f"the merge reads {100 * need // max(1, size)} % of it"
    if max_disk is not None and on_disk + size > max_disk:
        return STREAM, "downloading it would exceed --max-disk"
    return DOWNLOAD, f"the merge reads {100 * need // max(1, size)} % of it; merged as it lands in the cache"


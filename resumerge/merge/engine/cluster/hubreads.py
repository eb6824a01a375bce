"""Hub inputs streamed on a cluster: each node reads its shards' byte ranges from the hub itself, through a fetch
cache of its own.

The driver hands every worker a :class:`NodeReads` with its setup: the streamed files (repo, the commit the plan
pinned, size and endpoint: nothing secret), whether the driver read them with a token, and the run's fetch cache
(name and byte limit). The worker opens :class:`NodeSources`: a :class:`~resumerge.inputs.hub.stream.HubStream`
per hub model whose streamed files go through the node's
:class:`~resumerge.inputs.hub.fetchcache.FetchCache` (in a folder of the node's temp folder that only this user may
enter, one per run and node, deleted when a worker's pipeline ends), so a worker fetches no byte twice and the
node's workers share what each had fetched when they first opened a file, and whose read-ahead is told the reads of
the shards fed to this worker only, so a node never fetches the tensors of another node's shards.

Every range a node reads is hashed; each shard's :class:`~resumerge.merge.engine.cluster.worker.ShardDone` carries the
digests gathered since the one before, and the driver checks them against its ledger
(:meth:`~resumerge.merge.engine.inputfetch.HubInputs.read_elsewhere`, as a local run checks its own reads) before it
publishes the shard: a range that gave other bytes than recorded ends the run (exit 4) with nothing of it
committed. Unlike a local run, no process reads a whole file, so the file's own sha256 (the hub's LFS or Xet
checksum) is not checked on a cluster: the ranges' digests are recorded on their first read and checked on every
later one, and the bytes come from the commit the plan pinned. The token never travels: a node reads its own
(``HF_TOKEN``, or its user's saved login), and one without any fails its shards in one line, exit 2, when the
driver read the inputs with one.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from resumerge.errors import UsageError
from resumerge.inputs.source import InputSource, InputSources, LocalFiles
from resumerge.inputs.tensorio import TensorReader
from resumerge.machine.memory import MemoryGovernor
from resumerge.merge.plan.merge_plan import Plan, ShardPlan

# The hub's modules (huggingface_hub, the range client and its HTTP stack: a second of a worker's start, on the
# path to its first shard) are imported where a run streams hub inputs, not by every node's worker.
if TYPE_CHECKING:
    from resumerge.inputs.hub.fetchcache import FetchCache
    from resumerge.inputs.hub.ranges import FetchCounters, StreamedFile
    from resumerge.inputs.hub.stream import Check
    from resumerge.merge.engine.job import Job

# What a node's fetch cache may hold without --max-disk (with it: what its staged shards leave), all its workers'
# pieces together.
CACHE_LIMIT = 4 * 1024**3

# A range a node read: (model, file, start, end, sha256).
ReadDigest = tuple[str, str, int, int, str]


@dataclass(frozen=True)
class NodeReads:
    """The hub inputs a node streams: the files, whether a token read them on the driver (then every node needs its
    own), and the run's fetch cache (its name, unique to the plan, and the bytes one worker's pieces may hold: see
    :meth:`shared_by`)."""

    files: tuple[StreamedFile, ...]
    token: bool
    cache: str
    limit: int
    staged: int = 0  # under --max-disk, the disk a worker's staged shard may take beside the cache

    @classmethod
    def of(cls, job: Job) -> NodeReads | None:
        """The streamed files of ``job``'s hub inputs (None when it streams none), the cache's limit that of a node
        with one worker."""
        if job.hub is None or not job.hub.remote:
            return None
        from huggingface_hub import get_token

        max_disk = job.settings.max_disk
        largest = max((s.file_size for s in job.plan.shards), default=0)
        limit = CACHE_LIMIT if max_disk is None else max(0, max_disk - largest)
        return cls(job.hub.remote, bool(get_token()), job.plan.fingerprint[:16], limit,
                   0 if max_disk is None else largest)

    def shared_by(self, workers: int) -> NodeReads:
        """These reads for one of ``workers`` workers of a node: each counts only its own pieces, so the node's
        limit (less the other workers' staged shards) is split between them."""
        if workers <= 1:
            return self
        return replace(self, limit=max(0, self.limit - (workers - 1) * self.staged) // workers)


class NodeSources:
    """A worker's input sources: hub inputs streamed from the hub through the node's fetch cache (local and
    downloaded files read where the plan says), every streamed range's digest kept until :meth:`drain`."""

    def __init__(self, plan: Plan, reads: NodeReads | None, governor: MemoryGovernor | None, node: str) -> None:
        """Raises :class:`UsageError` (exit 2) when the driver read the inputs with a token and this node has none."""
        self.plan = plan
        self.counters: FetchCounters | None = None  # the hub's, where it streams
        self._digests: list[ReadDigest] = []
        self._counted = 0  # fetched bytes handed back already
        self._lock = threading.Lock()
        self.cache: FetchCache | None = None
        if reads is None:
            self.sources = InputSources.local(plan.model_dirs)
            return
        from huggingface_hub import get_token

        from resumerge.inputs.hub.fetchcache import FetchCache, private_root
        from resumerge.inputs.hub.ranges import FetchCounters
        from resumerge.inputs.hub.stream import HubStream
        from resumerge.merge.engine.inputfetch import coalesce_for, read_ahead_grants

        self.counters = counters = FetchCounters()
        if reads.token and not get_token():
            raise UsageError(f"cluster node {node} has no Hugging Face token to read the hub inputs with",
                             hint="set HF_TOKEN (or run `hf auth login`) on every node, then resumerge resume OUT")
        self.cache = FetchCache(private_root(f"{reads.cache}-{node}"), reads.limit)
        agent = f"resumerge-node/{node}"
        streamed: dict[str, dict[str, StreamedFile]] = {}
        for f in reads.files:
            streamed.setdefault(f.model, {})[f.file] = f
        reader = TensorReader()
        sources: dict[str, InputSource] = {}
        for key, directory in plan.model_dirs.items():
            files = streamed.get(key)
            sources[key] = LocalFiles(directory, reader) if not files else HubStream(
                directory, {name: self.cache.reader(f.client(counters=counters, agent=agent))
                            for name, f in files.items()},
                reader=reader, reserve=read_ahead_grants(governor), check=self._hashing(key),
                coalesce_bytes=coalesce_for(governor))
        self.sources = InputSources(sources, shared=reader)

    def expect(self, shards: Sequence[ShardPlan]) -> None:
        """The shards this worker computes next: the only reads its read-ahead may fetch ahead of time."""
        tensors = self.plan.tensors
        self.sources.expect([(r.model, r.file, r.start, r.end) for shard in shards for name in shard.tensors
                             for r in tensors[name].reads() if r.end > r.start])

    def drain(self) -> tuple[tuple[ReadDigest, ...], int]:
        """The digests of the ranges read since the last call, and the bytes fetched from the hub meanwhile."""
        with self._lock:
            digests, self._digests = tuple(self._digests), []
        if self.counters is None:
            return digests, 0
        with self.counters.lock:
            fetched = self.counters.body_bytes - self._counted
            self._counted += fetched
        return digests, fetched

    def close(self) -> None:
        """Close the sources and delete the fetch cache (the pipeline it served ended)."""
        self.sources.close()
        if self.cache is not None:
            self.cache.clear()

    def _hashing(self, model: str) -> Check:
        def check(file: str, start: int, end: int, data: bytearray) -> None:
            digest = hashlib.sha256(data).hexdigest()
            with self._lock:
                self._digests.append((model, file, start, end, digest))

        return check

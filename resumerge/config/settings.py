"""How a run is carried out, as frozen objects: everything the user may change between two runs of the same merge
without changing a byte of its output.

:class:`~resumerge.merge.plan.merge_plan.PlanOptions` holds what does change the output (it is part of the plan's
fingerprint); :class:`RunSettings` holds the rest — where state and the hub cache live, the memory, GPU and disk
budgets, staging, how an ``hf://`` OUT is created and committed (:class:`HubOutputOptions`, :class:`Batching`), and
the threads. :mod:`resumerge.api` builds one from its keyword parameters; every layer below — the engine and the
planners of MoE upcycling and LoRA extraction alike — takes it whole instead of a parameter per knob.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from resumerge.config.locations import StateDir
from resumerge.errors import UsageError

# How to stage output: None = only when OUT is remote (Drive), True/False = always/never, or a directory.
Staging: TypeAlias = "bool | str | os.PathLike[str] | None"

# The hub allows 128 commits per repo and hour ("You have exceeded the rate limit for repository commits (128 per
# hour)"). This process makes at most HOURLY_COMMITS in any hour, leaving room for retries and other writers.
HOURLY_COMMITS = 100

# How long a Ray run's kept workers (``--keep-workers``: :mod:`resumerge.machine.cluster.kept`) wait idle for the
# next run on their cluster before they end.
KEEP_WORKERS = 600.0



@dataclass(frozen=True)
class Batching:
    """When to commit: once ``every`` uploaded files wait, or ``interval`` seconds after the oldest waiting one.

    The bound on commits: a batch is due at ``every`` files or ``interval`` seconds, so with the defaults (20 files,
    60 s) and the default 1 GB shards an hour holds at most about 61 commits when files come slower than one every
    3 s, and one per 20 files when faster: a 405B model (about 820 files) stays at 61 or fewer in any hour,
    whatever its pace. Only above 2,560 files an hour (a small ``--out-shard-size``, or 1 GB shards uploaded at a
    sustained 0.7 GB/s) would
    batching exceed the lowest observed quota of 128 an hour. What bounds every case is ``hourly``: every commit
    of the run (batches, manifest-only commits, deletions) first waits (:func:`pace_wait`) until at most
    ``hourly`` (100) commits of this process fall in any hour; files then wait longer and go into bigger commits.
    A resume counts afresh: the killed run's commits of the last hour use the margin of 28, and beyond it the
    hub's 429 is waited out (:func:`with_retries`). Tested on a simulated clock in ``tests/hubout/test_hub_quotas.py``.
    """

    every: int = 20
    interval: float = 60.0
    hourly: int = HOURLY_COMMITS  # commits allowed in any hour; a commit beyond it waits for the window to move
    # Past ``burst`` commits in the last hour, each commit waits ``spacing`` seconds after the one before.
    burst: int = HOURLY_COMMITS
    spacing: float = 0.0

    @classmethod
    def pipelined(cls) -> Batching:
        """The default of ``resumerge run``: every file is committed as soon as it is uploaded (a kill then loses
        at most the files in flight), the first 20 in an hour at once, then one commit a minute at most, each taking
        every file uploaded meanwhile; the run's last commit, of every file left once all are uploaded, waits for
        no minute. An hour holds at most 20 + 60 + 1 = 81 commits of a run, and a run killed and resumed within one
        hour at most 102 between them: under the hub's 128 without relying on the ``hourly`` cap."""
        return cls(every=1, interval=60.0, burst=20, spacing=60.0)


@dataclass(frozen=True)
class HubOutputOptions:
    """How a hub repo OUT is written: created public or private (the default), and how commits are batched."""

    public: bool = False
    batching: Batching = field(default_factory=Batching)

    @classmethod
    def of(cls, *, public: bool, every: int | None, interval: float | None) -> HubOutputOptions:
        """The options of ``--public``, ``--commit-every`` and ``--commit-interval`` (None: not given). Without
        either, each file is committed once uploaded, paced under the hub's quota (:meth:`Batching.pipelined`);
        with one, commits are batched (the other at :class:`Batching`'s default). Raises UsageError (exit 2)."""
        if (every is not None and every < 1) or (interval is not None and interval < 0):
            raise UsageError("--commit-every must be at least 1 and --commit-interval at least 0")
        if every is None and interval is None:
            return cls(public=public, batching=Batching.pipelined())
        default = Batching()
        return cls(public=public, batching=Batching(every=every or default.every,
                                                    interval=default.interval if interval is None else interval))


class RunExecutor(Protocol):
    """What computes a run's pending shards, as the caller handed it in, its own settings on it
    (:mod:`resumerge.merge.engine.executors`: ``LocalExecutor``, ``RayExecutor(address, keep_workers)``). The settings
    only carry it to the engine, which holds the whole protocol; ``name`` is how messages name it."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class RunSettings:
    """The settings of one run that never change its output bytes (a resume may pass others than the first run).

    ``state`` holds ledgers (resolved once at the front door; default: the state dir in force when the settings
    are made); ``cache_dir`` is the
    Hugging Face cache for hub models (``--transformers-cache``). ``max_memory`` and ``max_gpu_memory`` are budgets
    in bytes (None: a safe fraction of what the machine, container or GPU allows). ``staging``: None stages output
    on local disk only when OUT is remote (Drive), True always, False never, or a directory to stage in.
    ``max_disk`` bounds the bytes kept on the local disk for the output (an ``hf://`` OUT's uncommitted files);
    ``output`` says how an ``hf://`` OUT is created and its commits batched. ``num_threads`` is torch's thread count
    (None: torch's choice). ``executor`` computes the shards (None: this process; the bytes are the same whichever
    does, so a run started with one resumes with another).
    """

    state: StateDir = field(default_factory=StateDir.resolve)
    cache_dir: str | os.PathLike[str] | None = None
    max_memory: int | None = None
    max_gpu_memory: int | None = None
    staging: Staging = None
    max_disk: int | None = None
    output: HubOutputOptions = field(default_factory=HubOutputOptions)
    num_threads: int | None = None
    executor: RunExecutor | None = None  # None: LocalExecutor (this process)

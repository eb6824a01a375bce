"""The executor seam: what computes a run's pending shards, this process or a cluster, behind one small protocol.

The session (:mod:`resumerge.engine.drive`) plans, opens OUT, reconciles and owns the ledger; it hands one
:class:`Job` to an :class:`Executor` and does not know which one it has. Every executor computes the same bytes
(the pipeline of :func:`~resumerge.engine.executor.compute_shards`, wherever it runs) and journals them through the
same :class:`~resumerge.store.journal_commit.CommitJournal` in the calling process, so a run started with one
executor resumes with the other. Implementations: :class:`LocalExecutor` (threads of this process) and
:class:`~resumerge.engine.cluster.driver.RayExecutor` (a worker per node of a Ray cluster).
"""

from __future__ import annotations

from typing import Protocol

from resumerge.config.settings import LOCAL, RunSettings
from resumerge.engine.executor import CONCURRENCY, execute
from resumerge.engine.job import Job
from resumerge.errors import UsageError


class Executor(Protocol):
    """Brings every pending file of a :class:`Job` to committed; returns the late notes (as
    :func:`~resumerge.engine.executor.execute`). Raises :class:`~resumerge.engine.executor.Stopped` when the job's
    stop flag turns, and a failed shard's own error (the same one, whichever executor computed it)."""

    def run(self, job: Job) -> tuple[str, ...]: ...


class LocalExecutor:
    """The shards computed by threads of this process (the default)."""

    def run(self, job: Job) -> tuple[str, ...]:
        """:func:`~resumerge.engine.executor.execute` of ``job``."""
        return execute(job.plan, job.sources, job.sink, job.ledger, job.book, job.reporter,
                       should_stop=job.should_stop, config_text=job.config_text, workers=CONCURRENCY,
                       governor=job.governor, gpu=job.gpu, late_notes=job.late_notes, transfers=job.transfers,
                       resources=job.resources)


def executor_for(settings: RunSettings, *, work_beside: bool = False) -> Executor:
    """The executor ``settings`` name for a run that has work beside the merge (``work_beside``: a mergekit-moe
    prompt pass whose routers the last units wait for) or not. Raises :class:`~resumerge.errors.UsageError`
    (exit 2) for ``ray`` when Ray is not installed, saying how to install it, and for a run with work beside it
    (its results live in this process, where no task can see them)."""
    if settings.executor == LOCAL:
        return LocalExecutor()
    if work_beside:
        raise UsageError("--executor ray cannot run a mergekit-moe config whose gates read prompts yet",
                         hint="run it with the local executor (the default)")
    from resumerge.engine.cluster.driver import RayExecutor
    from resumerge.engine.cluster.warm import WarmStart

    early = settings.early if isinstance(settings.early, WarmStart) else None
    return RayExecutor.connect(settings.ray_address, early)

"""The executor seam: what computes a run's pending shards, this process or a cluster, behind one small protocol.

The session (:mod:`resumerge.merge.engine.drive`) plans, opens OUT, reconciles and owns the ledger; it hands one
:class:`Job` to an :class:`Executor` and does not know which one it has. Every executor computes the same bytes
(the pipeline of :func:`~resumerge.merge.engine.executor.compute_shards`, wherever it runs) and journals them through
the same :class:`~resumerge.merge.store.journal_commit.CommitJournal` in the calling process, so a run started with one
executor resumes with the other. An executor is an object the caller hands in (``executor=`` of the API functions),
its own settings on it: :class:`LocalExecutor` (threads of this process, the default) and :class:`RayExecutor`
(a worker per node of a Ray cluster: :mod:`resumerge.merge.engine.cluster`). A new executor is one more such class
and its row of :data:`resumerge.config.passplace.EXECUTORS` (the command line's ``--executor NAME``, where its passes
run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from resumerge.config.passplace import HERE, PassPlace
from resumerge.config.settings import KEEP_WORKERS, RunSettings
from resumerge.errors import UsageError
from resumerge.merge.engine.executor import CONCURRENCY, Computing, compute_shards, kept_units
from resumerge.merge.engine.job import Job
from resumerge.merge.engine.runend import finish_run
from resumerge.merge.engine.writer import InPlace

if TYPE_CHECKING:
    from resumerge.merge.engine.cluster.warm import WarmStart


@runtime_checkable
class Executor(Protocol):
    """Computes a run's pending shards. ``name`` names it in messages; ``beside_ok`` whether it can run a plan with
    work beside the merge (a mergekit-moe prompt pass whose routers live in this process); ``starts_early`` whether
    :meth:`starting` can start anything while the run plans (then the API reads the recorded device first)."""

    @property
    def name(self) -> str: ...

    @property
    def beside_ok(self) -> bool: ...

    @property
    def starts_early(self) -> bool: ...

    def check(self) -> None:
        """Raise :class:`~resumerge.errors.UsageError` (exit 2), before any work, when this executor cannot run
        here (what it needs is not installed, a setting is out of range)."""

    def starting(self, settings: RunSettings, *, device: str | None,
                 bounded: bool) -> contextlib.AbstractContextManager[Executor]:
        """This executor, with what it starts while the run plans (its own to close as the context ends), for a run
        computing on ``device`` (None: not known yet) whose output is ``bounded`` by ``--max-disk`` on the hub."""

    def run(self, job: Job) -> tuple[str, ...]:
        """Bring every pending file of ``job`` to committed; returns the late notes (as
        :func:`~resumerge.merge.engine.executors.execute`). Raises :class:`~resumerge.merge.engine.executor.Stopped`
        when the job's stop flag turns, and a failed shard's own error (the same one, whichever executor computed
        it)."""


@runtime_checkable
class PlacesPasses(Protocol):
    """An executor that places a forward pass (``check``'s, ``measure``'s) as well as a merge's shards."""

    def place_pass(self) -> PassPlace:
        """Where a forward pass runs on this executor (:class:`~resumerge.config.passplace.PassPlace`, named as the
        executor is: the site its row of :data:`resumerge.config.passplace.EXECUTORS` names runs it). Raises
        :class:`~resumerge.errors.UsageError` (exit 2), before any work, where it cannot run here."""


@dataclass(frozen=True)
class LocalExecutor:
    """The shards computed by threads of this process (the default)."""

    name: ClassVar[str] = "local"
    beside_ok: ClassVar[bool] = True
    starts_early: ClassVar[bool] = False
    # An optional attribute (an executor without it commits files whole): whether it writes a file planned in units
    # (a GGUF output) in place, journaling each unit (resumerge.merge.store.units), where the sink can.
    journals_units: ClassVar[bool] = True
    # An optional attribute (an executor without it computes elsewhere): whether this process computes the tensors,
    # so that torch is imported here while the run's proof reads its inputs
    # (resumerge.machine.torch_import.load_beside).
    computes_here: ClassVar[bool] = True

    def check(self) -> None:
        """Nothing to check: this process computes."""

    @contextlib.contextmanager
    def starting(self, settings: RunSettings, *, device: str | None, bounded: bool) -> Iterator[Executor]:
        """Itself: nothing starts early."""
        yield self

    def place_pass(self) -> PassPlace:
        """A forward pass runs in this process."""
        return HERE

    def run(self, job: Job) -> tuple[str, ...]:
        """:func:`~resumerge.merge.engine.executors.execute` of ``job``."""
        return execute(job, CONCURRENCY)


@dataclass(frozen=True)
class RayExecutor:
    """The shards computed by a worker per node of the Ray cluster at ``address`` (None: ``RAY_ADDRESS``, else a
    Ray started for the run; OUT and the inputs must be paths every node sees). On a cluster that outlives the run
    its workers stay for the next one, idle for at most ``keep_workers`` seconds (0: they end with the run), holding
    no CPU while idle; they host a forward pass's actors too (``check``, ``measure``, ``eval``, ``evolve``).
    ``early`` is the warm start :meth:`starting` made for one call (not a setting)."""

    address: str | None = None
    keep_workers: float = KEEP_WORKERS
    early: WarmStart | None = field(default=None, compare=False, repr=False)
    name: ClassVar[str] = "ray"
    # Results of the work beside a merge live in this process, where no task can see them.
    beside_ok: ClassVar[bool] = False
    starts_early: ClassVar[bool] = True

    def check(self) -> None:
        """Raises UsageError when Ray is not installed (saying how to install it) or ``keep_workers`` is negative."""
        if self.keep_workers < 0:
            raise UsageError("--keep-workers must be at least 0")
        from resumerge.machine.rayconnect import check_ray

        check_ray()

    def place_pass(self) -> PassPlace:
        """A forward pass runs an actor per model on the cluster (on one that outlives the pass, hosted by the
        nodes' kept workers, idle for ``keep_workers`` after it: :mod:`~resumerge.machine.cluster.hosting`); raises
        UsageError where Ray is not installed."""
        self.check()
        from resumerge.merge.engine.cluster import STREAM

        return PassPlace(self.name, self.address, self._pass_keep(), STREAM)

    def _pass_keep(self) -> float:
        """How long a pass's kept workers wait idle once it ends: ``keep_workers`` on a cluster that outlives the
        pass (``address``, ``RAY_ADDRESS``, or the one this process is connected to, as a merge's run keeps its
        workers); 0 (fresh actors, ended with the pass) on a Ray the pass would start itself. Asked before the
        pass joins the cluster."""
        import os
        import sys

        ray = sys.modules.get("ray")
        connected = ray is not None and ray.is_initialized()
        outlives = connected or self.address or os.environ.get("RAY_ADDRESS")
        return float(self.keep_workers or 0.0) if outlives else 0.0

    @contextlib.contextmanager
    def starting(self, settings: RunSettings, *, device: str | None, bounded: bool) -> Iterator[Executor]:
        """With the run's workers starting while it plans (:mod:`resumerge.merge.engine.cluster.warm`), those the run
        did not take ended as the context ends, however it ends. Itself where warm workers could not serve: a GPU run
        (they start without one), a ``device`` not known yet, a hub OUT under ``--max-disk`` whose workers end with
        it (how many a node may run, each declaring its CPUs as it starts, depends on the plan's shard size: kept
        workers declare none, so they serve any), and where there is no cluster to join before the run."""
        if device != "cpu" or (bounded and self.keep_workers <= 0):
            yield self
            return
        from resumerge.merge.engine.cluster.warm import WarmStart

        warm = WarmStart.of(self.address, settings.num_threads, self.keep_workers)
        if warm is None:
            yield self
            return
        try:
            yield replace(self, early=warm)
        finally:
            warm.close()

    def run(self, job: Job) -> tuple[str, ...]:
        """The shards of ``job`` computed by the cluster's workers
        (:class:`~resumerge.merge.engine.cluster.driver.RayDriver`)."""
        from resumerge.merge.engine.cluster.driver import RayDriver

        return RayDriver.connect(self.address, self.early).run(job)


def executor_of(settings: RunSettings) -> Executor:
    """The executor ``settings`` carry (:class:`LocalExecutor` where none); raises UsageError for an object that
    is no :class:`Executor`."""
    chosen = settings.executor
    if chosen is None:
        return LocalExecutor()
    if not isinstance(chosen, Executor):
        raise UsageError(f"--executor must be an executor object (LocalExecutor, RayExecutor), not {chosen!r}")
    return chosen


def executor_for(settings: RunSettings, *, work_beside: bool = False) -> Executor:
    """The executor ``settings`` name for a run that has work beside the merge (``work_beside``: a mergekit-moe
    prompt pass whose routers the last units wait for) or not. Raises :class:`~resumerge.errors.UsageError`
    (exit 2) for one that cannot run such work."""
    executor = executor_of(settings)
    if work_beside and not executor.beside_ok:
        raise UsageError(f"--executor {executor.name} cannot run a mergekit-moe config whose gates read prompts yet",
                         hint="run it with the local executor (the default)")
    return executor


def execute(job: Job, workers: int = CONCURRENCY) -> tuple[str, ...]:
    """Bring every pending file of ``job.plan`` to committed, ``workers`` units in flight at most (the job's
    governors, stop flag, transfers and resources as :class:`~resumerge.merge.engine.executor.Computing` describes
    them); raises :class:`~resumerge.merge.engine.executor.Stopped` when ``job.should_stop`` turns true. Input tensors
    are read through ``job.sources`` and every output file is committed through ``job.sink``, whatever they are.
    ``job.late_notes`` gives notes found while the merge ran (by work beside it), added to the plan's before the
    side files (the model card) are written, and kept in the ledger and shown like them; they are returned."""
    from resumerge.merge.store.journal_commit import CommitJournal

    plan, sink, ledger = job.plan, job.sink, job.ledger
    done = {row.name for row in ledger.files() if row.status == "done"}
    journal = CommitJournal(sink, ledger, job.book)
    computing = Computing(job.should_stop, job.resources, workers, job.governor, job.gpu, job.transfers)
    interrupt: KeyboardInterrupt | None = None  # Ctrl-C where Python's own handler stands (library use)
    try:
        finished = compute_shards(plan, job.sources, sink, journal, job.reporter, done, computing,
                                  in_place=InPlace(ledger, kept_units(ledger, done)) if sink.writes_in_place else None)
    except KeyboardInterrupt as exc:
        interrupt, finished = exc, False
    return finish_run(plan, journal, job.reporter, done, finished=finished, interrupt=interrupt,
                      config_text=job.config_text, should_stop=job.should_stop, late_notes=job.late_notes)

"""One driver for every forward pass: a pass is a job (:class:`PassJob`), and :func:`drive` runs it, always in the
same order. The client (``check``, ``measure``, and any new pass: an importance matrix, a layer-streamed
generation) writes only what is its own, each part one method of its job:

====================  =============================================================================================
the driver            the job's part
====================  =============================================================================================
1. the lock           :attr:`PassJob.folder`: where the pass journals (found from its content key,
                      :func:`content_key`), the job in words, the command that runs it; one process at a time
                      (:func:`~resumerge.forward.job.folder.pass_lock`; a second is refused naming the first, exit 4)
2. the answer cache   :meth:`PassJob.answered`: a pass that finished before answers with what it wrote (its bytes
                      proved the same), or says why it runs (again); an answer kept as one JSON file in the
                      pass's folder is an :class:`AnswerFile`
3. the threads        the driver's: the thread count the pass computes with, decided as it first starts and kept
                      in its folder (:mod:`~resumerge.forward.job.threads`), applied to every step below, resumed ones
                      on a machine of another core count too (a float's bits depend on it)
4. the proof          :meth:`PassJob.proved`: what the journal holds proved against the bytes its models hold now
                      (:class:`~resumerge.forward.job.proof.PassProof`), in one line for the report
5. the fit            :meth:`PassJob.fitted`: the pass judged against the memory budget before any weight is read
                      (a :class:`Fit`: the budget, what each step reserves, the GPU's budget), with what the client
                      made to judge it (its models' modules, where they run: the placement) held open
6. admission          the driver's: each step held by the RAM governor (and the GPU's) while it runs
                      (:class:`~resumerge.forward.job.admission.Admission`, handed to the job as its ``reserve``)
7. the loop           :meth:`PassJob.run`: the client's :class:`~resumerge.forward.job.layerpass.Step` over the layers
                      (:class:`~resumerge.forward.job.layerpass.LayerPass`), what it found returned
8. the end            :meth:`PassJob.finish`: what the pass writes last (its report, its manifest), once what the
                      fit held is closed
9. Ctrl-C             :meth:`PassJob.stopped_at`: where it stopped, in words; the driver raises
                      :class:`~resumerge.errors.InterruptedMerge` (exit 3) naming the command that continues it
====================  =============================================================================================

A killed pass, run again, meets the same driver: the lock is free (it vanished with the process), the answer cache
is empty, the thread count is the one the pass started with, the proof holds the journal to the bytes, and the loop
resumes at the layer the journal reached.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from resumerge.errors import InterruptedMerge
from resumerge.forward.job.admission import Admission
from resumerge.forward.job.folder import pass_lock
from resumerge.forward.job.layerpass import Reserve, unreserved
from resumerge.forward.job.threads import pass_threads
from resumerge.machine.durable import write_file_atomic
from resumerge.machine.runlock import LOCK_NAME
from resumerge.machine.threadcount import THREADS_FILE

if TYPE_CHECKING:
    from resumerge.forward.engine.device import GpuBudget

Ready = TypeVar("Ready")
Ready_co = TypeVar("Ready_co", covariant=True)
Found = TypeVar("Found")
Answer = TypeVar("Answer")
Answer_co = TypeVar("Answer_co", covariant=True)


def content_key(parts: object) -> str:
    """The content key of a pass: the sha256 (hex) of ``parts`` as JSON (what makes its result: its models' files,
    the tokens, the versions of the code that computes it). The same parts, the same folder: a repeated pass finds
    its journal, and its answer."""
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


@dataclass(frozen=True)
class PassFolder:
    """Where a pass journals (``path``) and how its lock names it: the job in words (``what``), the shell command
    that runs it (a second process is told it, and Ctrl-C's line names it: ``command``), what a second process is
    told to do (``hint``) and the lock file's name in ``path``; ``wait``: a second process waits for the first
    instead of being refused (a pass whose folder two jobs share by content, the MoE gates': the second then finds
    the first's answer); ``threads``: the file keeping the thread count the pass computes with
    (:mod:`~resumerge.forward.job.threads`; None: ``threads.json`` in ``path``; a pass whose lock lives in a folder of
    many passes' locks, or in a user's output folder, keeps it beside its journal or named as its lock)."""

    path: Path
    what: str
    command: str
    hint: str
    lock_name: str = LOCK_NAME
    wait: bool = False
    threads: Path | None = None


def _as_is(answer: object) -> object:
    return answer


@dataclass(frozen=True)
class AnswerFile(Generic[Answer]):
    """An answer kept as one JSON file (``path``) in a pass's folder: written durably (temp, fsync, rename) once
    what it answers is computed, read back for the pass asked again. ``decode`` makes the answer of the file's
    JSON (raising ``ValueError``, ``KeyError`` or ``TypeError`` where it is not one), ``encode`` its JSON of an
    answer; the bytes are ``json.dumps``' of it, the file a pass's last write (a pass's answers) or a step's (a
    batch's, kept for a resume)."""

    path: Path
    decode: Callable[[Any], Answer]
    encode: Callable[[Answer], object] = _as_is

    def read(self) -> Answer | None:
        """The answer kept (None: none, or a file cut short by a crash: it is computed again)."""
        try:
            return self.decode(json.loads(self.path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, answer: Answer) -> None:
        """Keep ``answer``, durably (its folder made where it is not yet)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.path, json.dumps(self.encode(answer)).encode())


@dataclass(frozen=True)
class Fit(Generic[Ready_co]):
    """A pass judged against its budget before any weight is read: the ``budget`` (bytes) it runs under (None: its
    steps are not admitted here: they run where a placement holds them, a node that declared their memory, or in a
    test's pass), what each of its steps reserves from the RAM governor (``steps``: ``layer``, ``heads``...), on a
    GPU that device's budget (``gpu``), ``before(what, step)`` told before each step is admitted (progress, a trim
    of the heap), and ``ready``: what the client made to judge it, handed to :meth:`PassJob.run`."""

    budget: int | None
    steps: Mapping[str, int]
    ready: Ready_co
    gpu: GpuBudget | None = None
    before: Callable[[str, str], None] | None = None


class PassJob(Protocol[Ready, Found, Answer_co]):
    """A forward pass as the driver runs it (see the module docstring for the order)."""

    @property
    def folder(self) -> PassFolder:
        """Where the pass journals, and its lock's words."""

    def answered(self) -> tuple[Answer_co | None, str | None]:
        """The answer of a pass that finished before (None: it runs), and what looking found (a line for the report,
        as :meth:`proved`'s: a file changed since, so it runs again; None: nothing to say, :meth:`proved` asked)."""

    def proved(self) -> str | None:
        """What the journal holds proved against the models' bytes (raises
        :class:`~resumerge.errors.PlanChangedError`, exit 4, where it holds figures of other bytes); the proof's
        line for the report (None: nothing to say). The bytes are recorded before the first journal file."""

    def fitted(self) -> AbstractContextManager[Fit[Ready]]:
        """The pass's fit (refused, exit 2, before any weight is read where it does not fit), what it made held
        open for the block (the models' modules, the cluster's actors)."""

    def run(self, ready: Ready, reserve: Reserve) -> Found:
        """The pass itself, ``ready`` as :meth:`fitted` made it, each step admitted by ``reserve``."""

    def finish(self, found: Found, proof: str | None) -> Answer_co:
        """What the pass writes last, once :meth:`fitted`'s block closed; its answer (``proof``: the proof's line)."""

    def stopped_at(self) -> str | None:
        """Where an interrupted pass stopped, in words (Ctrl-C's line, before the command that continues it); None:
        the pass is a part of a larger job (the MoE gates', inside a merge) whose own Ctrl-C line names the command
        that continues both, and the interrupt goes on to it."""


def drive(job: PassJob[Ready, Found, Answer]) -> Answer:
    """Run ``job``: its folder locked, answered from its cache, or proved, fitted, run under admission and
    finished with the thread count the pass first started with; Ctrl-C raises
    :class:`~resumerge.errors.InterruptedMerge` (exit 3) naming where it stopped and the command that continues it
    (see the module docstring)."""
    folder = job.folder
    lock = pass_lock(folder.path, folder.what, folder.command, hint=folder.hint, name=folder.lock_name,
                     wait=folder.wait)
    lock.acquire()
    try:
        answer, said = job.answered()
        if answer is not None:
            return answer
        with pass_threads(folder.threads or folder.path / THREADS_FILE):
            if said is None:
                said = job.proved()
            with job.fitted() as fit, admitted(fit) as reserve:
                found = job.run(fit.ready, reserve)
            return job.finish(found, said)
    except KeyboardInterrupt:  # Ctrl-C: where it stopped, and the command that continues it
        stopped = job.stopped_at()
        if stopped is None:  # a part of a larger job, which says it
            raise
        raise InterruptedMerge(stopped, resume_command=folder.command) from None
    finally:
        lock.release()


@contextmanager
def admitted(fit: Fit[object]) -> Iterator[Reserve]:
    """The ``reserve`` of a pass so fitted: each of its steps held by the RAM governor (and the GPU's, on one) for as
    long as it runs, the governors living as long as the block (no budget: nothing admitted here)."""
    if fit.budget is None:
        yield unreserved
        return
    with Admission(fit.budget, fit.steps, fit.before, fit.gpu) as admission:
        yield admission

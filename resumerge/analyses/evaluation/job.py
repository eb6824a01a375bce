"""An evaluation's passes as the pass driver runs them (:func:`~resumerge.forward.job.driver.drive`): each pass lm-eval
asks of the model (``loglikelihood``, ``loglikelihood_rolling``) and each text task's (:mod:`.texttasks`) is an
:class:`EvalJob` whose folder is ``evals/<key>`` under the state dir (:func:`pass_key`), whose answer cache is the
file its step keeps last (:func:`~.scorer.answers_file`, :func:`~.textpass.figures_file`), whose steps are
:func:`~.scorer.score`'s or :func:`~.textpass.score_texts`' and whose layers run where the executor placed the pass
(:mod:`.placed`). :class:`EvalPasses` makes the jobs of one evaluation (``eval``'s and the lm-eval door's) and
keeps what they share: the model, its modules, the proof's lines and the progress (:class:`EvalProgress`: the
``status`` file, the watcher, Ctrl-C's line)."""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from resumerge.analyses.evaluation.requests import Scoring
from resumerge.analyses.evaluation.scorer import Answer, Places, answers_file, score
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.status import LAYER_PREFIX, PROGRESS_NAME
from resumerge.analyses.evaluation.tails import tail_step_bytes
from resumerge.analyses.evaluation.textpass import figures_file, score_texts
from resumerge.analyses.evaluation.texttasks import TextFigures
from resumerge.analyses.evaluation.textwork import TextWork, digest_of, text_heads_bytes
from resumerge.config.locations import StateDir
from resumerge.forward.compared.needs import step_bytes
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import AnswerFile, Fit, PassFolder, content_key, drive
from resumerge.forward.job.journal import Journal, latest
from resumerge.forward.job.layerpass import Reserve
from resumerge.forward.job.proof import JournalProof
from resumerge.forward.opening.opened import PassModel
from resumerge.forward.text.batches import BATCH_TOKENS
from resumerge.machine.durable import write_file_atomic
from resumerge.machine.memory import SystemProbe, budget_fitting
from resumerge.machine.memory.allocator import give_back_heap

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.placed import EvalLayers
    from resumerge.forward.engine.device import GpuBudget
    from resumerge.merge.engine.unwritten import UnwrittenMerge

Found = TypeVar("Found")
# (where its layers run, its steps' reserve, told each layer as it starts, None: the head) -> what the pass found
Scored = Callable[[Places, Reserve, Callable[[int | None], None]], Found]


@dataclass(frozen=True)
class EvalStep:
    """Where an evaluation is: its ``target``, the ``tasks``, the pass (``kind``: ``loglikelihood`` or
    ``loglikelihood_rolling``, ``generate_until``; its ``requests``), the ``layer`` running (None: the head) of
    ``layers``; a generation's token ``step`` of at most ``steps``, and its estimate (``plan``), said once before it
    starts."""

    target: str
    tasks: tuple[str, ...]
    kind: str
    requests: int
    layer: int | None
    layers: int
    step: int | None = None
    steps: int | None = None
    plan: str | None = None


Watcher = Callable[[EvalStep], None]


class EvalProgress:
    """Where an evaluation of ``target`` (the ``model`` its passes read, named by ``status`` as :func:`where_of`
    names it) is, pass after pass: written to each pass's folder for ``status`` (``progress.json``), told to the
    ``watcher``, and said on Ctrl-C with the ``command`` that continues."""

    def __init__(self, target: str, model: PassModel, tasks: tuple[str, ...], command: str,
                 watcher: Watcher | None) -> None:
        self.target, self.model, self.tasks, self.command, self.watcher = target, model, tasks, command, watcher
        self.step: EvalStep | None = None
        self.workdir: Path | None = None

    def say(self, workdir: Path, step: EvalStep, done: bool = False) -> None:
        """``step`` reached in the pass journaled in ``workdir`` (``done``: the pass finished)."""
        self.step = step
        doc = {"target": step.target, "model": where_of(self.model), "tasks": list(step.tasks), "pass": step.kind,
               "requests": step.requests, "layer": step.layer, "layers": step.layers, "pid": os.getpid(),
               "command": self.command, "done": done}
        write_file_atomic(workdir / PROGRESS_NAME, (json.dumps(doc) + "\n").encode())
        if self.watcher is not None and not done:
            self.watcher(step)

    def stopped(self) -> str:
        """Ctrl-C's line: the evaluation interrupted, and where (:meth:`where`)."""
        return f"the evaluation of {self.target} was interrupted{self.where()}"

    def where(self) -> str:
        """Where the evaluation stopped, in words (before its first layer: that)."""
        step = self.step
        if step is None:
            return " before its first layer"
        pass_ = f"of its {step.kind} pass"
        if step.layer is None:
            return f" in the head {pass_} (every layer journaled)"
        found = latest(self.workdir, LAYER_PREFIX) if self.workdir is not None else None
        if found is not None and found[0] >= step.layer:
            return f" after layer {found[0] + 1} of {step.layers} {pass_} (layers 1-{found[0] + 1} journaled)"
        kept = f"layers 1-{step.layer} journaled" if step.layer else "no layer journaled yet"
        return f" in layer {step.layer + 1} of {step.layers} {pass_} ({kept})"


@dataclass(frozen=True)
class Merged:
    """What an unwritten merge adds to a pass: its plan's fingerprint (in the pass's key: the same config over
    changed inputs is another model) and the largest working set of one tensor's merge (``merge_bytes``: each
    merge is admitted by the merge's own governor as ``run`` admits its units, beside what the pass holds)."""

    fingerprint: str
    merge_bytes: int
    merge: UnwrittenMerge  # what each step's merges hold (:func:`~.unwrittenneeds.merged_need`)

    @classmethod
    def of(cls, unwritten: UnwrittenMerge | None) -> Merged | None:
        if unwritten is None:
            return None
        return cls(unwritten.plan.fingerprint, unwritten.merge_bytes, unwritten)


@dataclass(frozen=True)
class PassNeed:
    """What a pass holds: ``states`` (the hidden states in and out) beside its largest step (of ``steps``:
    ``layer``, ``heads``; ``peak``: a merge never written's largest step with its merges, None where not known
    better) and, beside a step, a merge never written's largest merge (``merging``: each tensor merged as it is
    read, admitted by its own governor)."""

    states: int
    steps: dict[str, int]
    peak: int | None
    merging: int

    def judged(self, settings: EvalSettings, layers_here: bool) -> PassFit:
        """The pass's budget and the GPU's (``layers_here`` False: the layers on a Ray node, the heads alone
        here); refused (:class:`~resumerge.errors.UsageError`, exit 2) where what it holds does not fit
        ``settings``' ``--max-memory`` (or ``--max-gpu-memory``)."""
        largest = max(self.steps.values()) if layers_here else self.steps["heads"]
        give_back_heap()  # the process read as the pass runs beside it, not with what was freed before
        budget = budget_fitting("the evaluation", self.states + (largest + self.merging if self.peak is None
                                                                 else self.peak), settings.max_memory, SystemProbe())
        gpu = settings.pass_device().budget("the evaluation", self.steps, self.states)  # None on the CPU
        return PassFit(budget, self.steps, gpu)


@dataclass(frozen=True)
class PassFit:
    """A pass judged against its budgets: the RAM's (``budget``), what each step reserves, the GPU's (None: the
    CPU)."""

    budget: int
    steps: dict[str, int]
    gpu: GpuBudget | None


@dataclass(frozen=True)
class EvalJob(Generic[Found]):
    """One of an evaluation's passes as the pass driver runs it (:class:`~resumerge.forward.job.driver.PassJob`): its
    ``cache`` the answer of a pass finished before (kept while ``proof`` holds it to the models' bytes), its
    ``fit`` judged before the driver is handed the job (:meth:`PassNeed.judged`: a pass its budget refuses is
    refused whatever its cache holds, its folder neither locked nor read, no weight hashed), its layers where
    ``placed`` puts them, its step ``scored``, its progress told as the pass ``kind`` of ``requests`` requests
    runs."""

    folder: PassFolder
    cache: AnswerFile[Found]
    proof: JournalProof
    fit: PassFit
    settings: EvalSettings
    placed: Callable[[], Places]
    scored: Scored[Found]
    progress: EvalProgress
    kind: str
    requests: int
    model_layers: int

    def answered(self) -> tuple[Found | None, str | None]:
        """The answer kept of this pass, where the models' bytes still are those it was computed from (a line
        said where one changed: the answer goes, the pass runs again)."""
        done = self.cache.read()
        if done is None or not self.proof.still_holds(self.cache.path):
            return None, None
        return done, None

    def proved(self) -> str | None:
        """The journal proved against the models' bytes (refused, exit 4, where a journaled layer's changed) and
        those bytes recorded, before the pass's next journal file; its lines are the proof's ``said``."""
        workdir = self.folder.path
        workdir.mkdir(parents=True, exist_ok=True)
        self.proof.before_resuming(Journal(workdir, LAYER_PREFIX))
        return None

    @contextmanager
    def fitted(self) -> Iterator[Fit[Places]]:
        """The fit judged before the job was driven, and the layers placed (refused, exit 2, where nothing can
        hold them)."""
        self.progress.workdir = self.folder.path
        fit = self.fit
        yield Fit(fit.budget, fit.steps, self.placed(), fit.gpu)

    def run(self, ready: Places, reserve: Reserve) -> Found:
        """The pass's step, each layer told to the progress as it starts."""
        workdir, progress = self.folder.path, self.progress

        def on_layer(layer: int | None) -> None:
            progress.say(workdir, EvalStep(progress.model.path, self.settings.tasks, self.kind, self.requests, layer,
                                           self.model_layers))

        return self.scored(ready, reserve, on_layer)

    def finish(self, found: Found, proof: str | None) -> Found:
        """The pass's progress marked done (for ``status``); its answer, kept by its step."""
        if self.progress.step is not None:
            self.progress.say(self.folder.path, self.progress.step, done=True)
        return found

    def stopped_at(self) -> str:
        """Where the evaluation stopped (:meth:`EvalProgress.stopped`)."""
        return self.progress.stopped()


class EvalPasses:
    """The passes of one evaluation of ``model`` (its modules ``stream``): each one a job for the driver, its
    layers where ``layers`` runs them; ``inputs``: a merge never written's local inputs and what it reads of each,
    proved with each pass's journal as the model's own files are; ``said``: what proving the bytes found, a line
    each."""

    def __init__(self, stream: ModelStream, model: PassModel, settings: EvalSettings, state: StateDir,
                 progress: EvalProgress, layers: EvalLayers, merged: Merged | None = None,
                 inputs: tuple[list[PassModel], list[frozenset[str]]] = ([], [])) -> None:
        self.stream, self.model, self.settings, self.state = stream, model, settings, state
        self.progress, self.layers, self.merged, self.inputs = progress, layers, merged, inputs
        self.said: list[str] = []

    def __call__(self, work: Scoring, kind: str) -> list[Answer]:
        """The answers of one of lm-eval's passes (``kind``: ``loglikelihood`` or ``loglikelihood_rolling``)."""
        workdir = self.state.evals_dir / pass_key(self.model, kind, work.digest(), self.merged)
        proof = self._proof([self.model])
        sizes = step_bytes([self.stream], list(work.runs))
        steps = {"layer": max(sizes.layers), "heads": tail_step_bytes(self.stream, work.runs)}
        need = self._need(2 * sizes.states, steps, self._merged_peak(work.runs, steps))
        fit = need.judged(self.settings, self.layers.here)  # before the folder is locked or a weight is read

        def scored(places: Places, reserve: Reserve, on_layer: Callable[[int | None], None]) -> list[Answer]:
            return score(self.stream, work, workdir, places, reserve=reserve, on_layer=on_layer)

        return drive(self._job(workdir, answers_file(workdir), proof, fit,
                               lambda: self.layers.places(self.model, self.stream, sizes, self.state), scored, kind,
                               len(work.run_of)))

    def texts(self, work: TextWork) -> TextFigures:
        """The figures of a text task (:mod:`.texttasks`): the model (and a KL task's parent) over its texts, in
        this process whatever the executor (a parent runs beside the model)."""
        from resumerge.analyses.evaluation.placed import LayersHere

        workdir = self.state.evals_dir / pass_key(self.model, work.key(), digest_of(work.tokens), self.merged)
        proof = self._proof([self.model, *([work.parent] if work.parent is not None else [])])
        streams = [self.stream, *work.streams(self.stream, self.model.opened.config)]
        try:
            sizes = step_bytes(streams, work.tokens)
            steps = {"layer": max(sizes.layers), "heads": text_heads_bytes(streams, work.tokens)}
            alone = len(streams) == 1  # with a parent, its log-probabilities may be held beside the merge's head
            need = self._need(2 * len(streams) * sizes.states, steps,
                              self._merged_peak(work.tokens, steps) if alone else None)
            here = LayersHere()
            fit = need.judged(self.settings, here.here)  # before the folder is locked or a weight is read

            def scored(places: Places, reserve: Reserve, on_layer: Callable[[int | None], None]) -> TextFigures:
                return score_texts(streams, work.tokens, workdir, parent=len(streams) > 1, reserve=reserve,
                                   on_model=lambda layer, m: on_layer(layer), on_heads=lambda: on_layer(None),
                                   vocab=work.vocab)

            return drive(self._job(workdir, figures_file(workdir), proof, fit,
                                   lambda: here.places(self.model, self.stream, sizes, self.state), scored,
                                   work.task.kind, len(work.tokens)))
        finally:
            for parent in streams[1:]:
                parent.close()

    def _job(self, workdir: Path, cache: AnswerFile[Found], proof: JournalProof, fit: PassFit,
             placed: Callable[[], Places], scored: Scored[Found], kind: str, requests: int) -> EvalJob[Found]:
        # One process per pass: two at once would delete each other's layer files (issue 70).
        folder = PassFolder(workdir, f"this evaluation of {self.model.path}", self.progress.command,
                            hint="wait for it to finish (run again, it answers from its journal), or stop it (it "
                                 "resumes at the layer it reached)")
        return EvalJob(folder, cache, proof, fit, self.settings, placed, scored, self.progress, kind, requests,
                       self.stream.layers)

    def _proof(self, models: list[PassModel]) -> JournalProof:
        """The proof of a pass over ``models`` (and a merge never written's inputs), its lines said in :attr:`said`."""
        return JournalProof(models, f"this evaluation of {self.model.path}", *self.inputs, said=self.said)

    def _need(self, states: int, steps: dict[str, int], peak: int | None) -> PassNeed:
        # beside a step, an unwritten merge's read merges one tensor at a time (admitted by its governor)
        return PassNeed(states, steps, peak, self.merged.merge_bytes if self.merged is not None else 0)

    def _merged_peak(self, tokens: Sequence[Sequence[int]], steps: dict[str, int]) -> int | None:
        """A merge never written's largest step with its merges (None: a stored model's, or the sum of the
        largest step and the largest merge where that is not known better)."""
        if self.merged is None:
            return None
        from resumerge.analyses.evaluation.unwrittenneeds import merged_need

        return merged_need(self.stream, self.merged.merge, tokens, steps["heads"])


def where_of(model: PassModel) -> str:
    """The model as ``status`` finds it: a hub repo as named, a local path absolute."""
    return model.path if model.remote else os.path.abspath(model.path)


def pass_key(model: PassModel, kind: object, digest: str, merged: Merged | None) -> str:
    """The content key of a pass: the model's files' identities (an unwritten merge's: its plan's fingerprint),
    the pass's kind (a text task's: with its parent's files) and tokens (``digest``), the batch size and the
    versions of the code that computes it."""
    versions = [importlib.metadata.version(d) for d in ("transformers", "resumerge", "torch")]
    doc = [where_of(model),
           [[f.name, f.size, f.identity] for f in model.opened.files], kind, digest, BATCH_TOKENS, versions]
    if merged is not None:
        doc.append(merged.fingerprint)
    return content_key(doc)[:32]


__all__ = ["EvalJob", "EvalPasses", "EvalProgress", "EvalStep", "Merged", "Watcher", "pass_key"]

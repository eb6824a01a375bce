"""An evaluation from start to end: the settings and the tasks checked, the model opened (headers only), its
tokenizer, then lm-eval's evaluation (:mod:`.harness`) with :class:`~.lm.ResumergeLM` as the model, each of whose
passes is scored on the forward engine under the memory budget and journaled under the state dir (``evals/<key>``: a
killed evaluation run again resumes each pass where it stopped and ends with the same results); then the outputs
written as lm-eval's CLI writes them (:mod:`.outputs`).

Everything that can be refused is refused before any weight is read: the settings, a merge config as TARGET, a
TARGET that is not a model, an unknown task or one whose dataset cannot be loaded, and a pass whose largest step
does not fit the budget (before its first layer). A generation task holds the whole model where it fits, else runs
one decoder layer at a time for all its requests (:mod:`.streamgen`), judged before its first weight is read."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar

from resumerge.analyses.check.needs import StepBytes, step_bytes
from resumerge.analyses.evaluation.generate import resident_bytes
from resumerge.analyses.evaluation.report import EvalReport
from resumerge.analyses.evaluation.requests import Scoring
from resumerge.analyses.evaluation.scorer import ANSWERS, Answer, answered, score
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.status import LAYER_PREFIX, PROGRESS_NAME
from resumerge.analyses.evaluation.streamgen import Generation, GenStep, generated_by
from resumerge.analyses.evaluation.tails import tail_step_bytes
from resumerge.analyses.evaluation.tasks import TaskIndex, generation_tasks, loaded_tasks
from resumerge.analyses.evaluation.textpass import FIGURES, score_texts
from resumerge.analyses.evaluation.textpass import answered as answered_texts
from resumerge.analyses.evaluation.texttasks import TextFigures
from resumerge.analyses.evaluation.textwork import (
    TextWork,
    add_text_task,
    digest_of,
    no_lm_tasks,
    text_heads_bytes,
    text_work,
)
from resumerge.analyses.evaluation.yamltasks import yaml_text_tasks
from resumerge.config.locations import StateDir, is_default_state_root
from resumerge.errors import InterruptedMerge, UsageError
from resumerge.forward import Weights
from resumerge.forward.admission import Admission
from resumerge.forward.batches import BATCH_TOKENS
from resumerge.forward.folder import pass_lock
from resumerge.forward.journal import latest
from resumerge.forward.layerpass import Reserve
from resumerge.forward.opened import PassModel, open_for_pass
from resumerge.forward.proof import JournalProof, merge_inputs
from resumerge.forward.requires import Needs, require_transformers
from resumerge.forward.stream import ModelStream
from resumerge.forward.texts import tokenizer_at
from resumerge.memory import SystemProbe, budget_fitting
from resumerge.memory.allocator import tune_allocator
from resumerge.memory.cuda import is_gpu, normalise_device
from resumerge.store.durable import write_file_atomic

if TYPE_CHECKING:
    from resumerge.analyses.check.needs import StepBytes
    from resumerge.engine.unwritten import UnwrittenMerge
    from resumerge.forward.placement import Placement

_CONFIG_SUFFIXES = (".yml", ".yaml")
_NEEDS = Needs("resumerge eval", hint="pip install transformers lm-eval (in the resumerge clone: pip install -c "
               "constraints.txt -e '.[eval]')")


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
Found = TypeVar("Found")


def run_eval(target: str, settings: EvalSettings, *, state: StateDir, watcher: Watcher | None = None,
             unwritten: UnwrittenMerge | None = None, on_ray: bool = False,
             ray_address: str | None = None, ray_keep: float = 0.0,
             task_index: TaskIndex | None = None, merge_words: tuple[str, ...] = ()) -> EvalReport:
    """Evaluate the model at ``target`` (a folder, a GGUF file, ``hf://`` repo) on ``settings``' tasks and return
    lm-eval's results; ``unwritten``: ``target`` is a merge config, opened as the merge it describes (each tensor
    merged when read, never written). ``on_ray``: each pass's decoder layers on an actor of the Ray cluster at
    ``ray_address`` (check's :mod:`~resumerge.analyses.check.onray`; None: ``RAY_ADDRESS``, else a Ray started
    here), its head here: the same results, journaled alike (``ray_keep``: the seconds the kept worker hosting the
    actor waits idle once a pass ends, :func:`~resumerge.analyses.onray.kept_hosts`; 0: a fresh actor).
    ``task_index``: lm-eval's task index shared with other evaluations (a search's candidates; None: one of its
    own). ``merge_words``: the flags that merge ``unwritten`` as it was opened (in the command that continues). Raises
    :class:`UsageError` (exit 2) for anything refused before a weight is read, and :class:`InterruptedMerge` (exit
    3) on Ctrl-C, naming the command that continues."""
    if on_ray and is_gpu(normalise_device(settings.device)):  # the layers run on a Ray node, not this machine's GPU
        raise UsageError(f"--device {settings.device} runs the evaluation's layers on this machine's GPU, and "
                         "--executor ray runs them on a node of the cluster", hint="leave out one of the two")
    settings = settings.checked()
    if on_ray and unwritten is not None:
        raise UsageError("eval --executor ray reads a written model on a Ray node; a merge config is merged in this "
                         "process as its layers are read", hint="leave out --executor ray, or evaluate the written "
                                                                  "merge")
    model, weights = _pass_model(target, unwritten, state)
    manager = (task_index or TaskIndex()).manager(settings) if settings.lm_tasks else None
    # Loaded once: checked here, the same objects run by lm-eval (None: no lm-eval task named).
    loaded = loaded_tasks(settings, manager) if manager is not None else None
    if loaded is not None:
        settings = replace(settings, yaml_texts=yaml_text_tasks(loaded, settings.lm_tasks))
    # What lm-eval runs (None: no task, or every name a text task's YAML: lm-eval runs none)
    runs = loaded.runs(settings) if loaded is not None and settings.lm_tasks else None
    generating = generation_tasks(loaded.kinds) if loaded is not None else []
    tokenizer = _tokenizer(model, bool(settings.apply_chat_template))
    texts = [text_work(task, model, state) for task in settings.text_tasks]  # parents opened, texts tokenized
    command = eval_command(target, settings, state, merge_words)
    device = settings.pass_device()
    stream = ModelStream(weights, model.opened.config, _float32(), what="resumerge eval", key="TARGET",
                         device=device.name)
    restore_allocator = tune_allocator()
    # what a merge never written reads of its inputs, proved with each pass's journal as the model's own files are
    inputs = merge_inputs([unwritten.plan], state) if unwritten is not None else ([], [])
    scorer = _Scorer(stream, model, settings, state, command, watcher, _Merged.of(unwritten),
                     (ray_address, ray_keep) if on_ray else None, inputs)
    try:
        from resumerge.analyses.evaluation.lm import ResumergeLM

        if generating and on_ray:
            raise UsageError(f"eval --executor ray places the log-likelihood passes; the generation task(s) "
                             f"{', '.join(generating)} hold the whole model in this process",
                             hint="leave out --executor ray for them")
        if generating:
            _fits_streamed(stream, generating, settings)  # before any weight is read
        # the whole model held where it fits, else one layer at a time for every request (.streamgen)
        generation = _generation(target, model, weights, settings, state, command, watcher, scorer, stream)
        lm = ResumergeLM(tokenizer, _max_length(model, tokenizer), scorer,
                         generator=generated_by(generation, lambda: lm) if generating else None)
        results, tracker = _evaluate(lm, target, settings, runs) if runs is not None else \
            no_lm_tasks(target, settings)
        for work in texts:
            add_text_task(results, work, scorer.texts(work))
    except KeyboardInterrupt:
        raise InterruptedMerge(f"the evaluation of {target} was interrupted{scorer.where()}",
                               resume_command=command) from None
    finally:
        stream.close()
        if restore_allocator is not None:
            restore_allocator()
    from resumerge.analyses.evaluation.outputs import write_outputs

    written = write_outputs(results, tracker, settings) if tracker is not None else ()
    return EvalReport(target=target, results=results, written=written, proof="; ".join(scorer.said) or None)


def _evaluate(lm: Any, target: str, settings: EvalSettings, runs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """lm-eval's evaluation of the tasks ``runs`` (:meth:`~.tasks.LoadedTasks.runs`) with ``lm`` as the model, as
    its CLI runs it for these options but the machine's description (:mod:`.harness`), and the tracker that writes
    its files (None without ``output_path``)."""
    from lm_eval.loggers import EvaluationTracker

    from resumerge.analyses.evaluation.harness import evaluate_tasks

    tracker = EvaluationTracker(output_path=settings.output_path) if settings.output_path is not None else None
    return evaluate_tasks(lm, target, settings, runs, tracker), tracker


@dataclass(frozen=True)
class _Merged:
    """What an unwritten merge adds to a pass: its plan's fingerprint (in the pass's key: the same config over
    changed inputs is another model) and the largest working set of one tensor's merge (``merge_bytes``: each
    merge is admitted by the merge's own governor as ``run`` admits its units, beside what the pass holds)."""

    fingerprint: str
    merge_bytes: int
    merge: UnwrittenMerge  # what each step's merges hold (:func:`~.unwrittenneeds.merged_need`)

    @classmethod
    def of(cls, unwritten: UnwrittenMerge | None) -> _Merged | None:
        if unwritten is None:
            return None
        return cls(unwritten.plan.fingerprint, unwritten.merge_bytes, unwritten)


class _Scorer:
    """Scores each pass lm-eval asks of the model: the pass's journal folder (keyed by the model's files and the
    pass's tokens) locked, its steps admitted by the memory governor, its progress written for ``status``."""

    def __init__(self, stream: ModelStream, model: PassModel, settings: EvalSettings, state: StateDir, command: str,
                 watcher: Watcher | None, merged: _Merged | None = None,
                 ray: tuple[str | None, float] | None = None,
                 inputs: tuple[list[PassModel], list[frozenset[str]]] = ([], [])) -> None:
        self.stream, self.model, self.settings, self.state = stream, model, settings, state
        self.command, self.watcher, self.merged = command, watcher, merged
        self.ray = ray  # (the cluster's address, the kept hosts' idle time): the layers on a Ray actor; None: here
        self.inputs = inputs  # a merge never written: its local inputs and what it reads of each
        self.said: list[str] = []  # what proving the models' bytes found, a line each
        self.step: EvalStep | None = None
        self.workdir: Path | None = None

    def __call__(self, work: Scoring, kind: str) -> list[Answer]:
        """The answers of one of lm-eval's passes (``kind``: ``loglikelihood`` or ``loglikelihood_rolling``)."""
        workdir = self.state.evals_dir / _key(self.model, kind, work.digest(), self.merged)
        proof = self._proof([self.model])
        sizes = step_bytes([self.stream], list(work.runs))
        steps = {"layer": self._layer_bytes(sizes), "heads": tail_step_bytes(self.stream, work.runs)}
        peak = self._merged_peak(self.stream, work.runs, steps)
        done = answered(workdir)
        if done is not None and proof.still_holds(workdir / ANSWERS):
            # --max-memory judged as when it runs: the same command is refused or answered whatever is journaled
            self._budget(2 * sizes.states, steps, self.ray is None, peak)
            return done
        placed = None if self.ray is None else self._on_ray(sizes)  # the layers held by a Ray node

        def scored(reserve: Reserve, on_layer: Callable[[int | None], None]) -> list[Answer]:
            return score(self.stream, work, workdir, reserve=reserve, on_layer=on_layer, placed=placed, proof=proof)

        return self._locked(workdir, kind, len(work.run_of), 2 * sizes.states, steps, scored,
                            layers_here=placed is None, peak=peak)

    def texts(self, work: TextWork) -> TextFigures:
        """The figures of a text task (:mod:`.texttasks`): the model (and a KL task's parent) over its texts."""
        workdir = self.state.evals_dir / _key(self.model, work.key(), digest_of(work.tokens), self.merged)
        proof = self._proof([self.model, *([work.parent] if work.parent is not None else [])])
        streams = [self.stream, *work.streams(self.stream, self.model.opened.config)]
        try:
            sizes = step_bytes(streams, work.tokens)
            steps = {"layer": self._layer_bytes(sizes), "heads": text_heads_bytes(streams, work.tokens)}
            alone = len(streams) == 1  # with a parent, its log-probabilities may be held beside the merge's head
            peak = self._merged_peak(self.stream, work.tokens, steps) if alone else None
            done = answered_texts(workdir)
            if done is not None and proof.still_holds(workdir / FIGURES):
                self._budget(2 * len(streams) * sizes.states, steps, True, peak)  # judged as when it runs
                return done

            def scored(reserve: Reserve, on_layer: Callable[[int | None], None]) -> TextFigures:
                return score_texts(streams, work.tokens, workdir, parent=len(streams) > 1, reserve=reserve,
                                   on_model=lambda layer, m: on_layer(layer), on_heads=lambda: on_layer(None),
                                   vocab=work.vocab, proof=proof)

            return self._locked(workdir, work.task.kind, len(work.tokens), 2 * len(streams) * sizes.states, steps,
                                scored, peak=peak)
        finally:
            for parent in streams[1:]:
                parent.close()

    def _proof(self, models: list[PassModel]) -> JournalProof:
        """The proof of a pass over ``models`` (and a merge never written's inputs), its lines said in :attr:`said`."""
        return JournalProof(models, f"this evaluation of {self.model.path}", *self.inputs, said=self.said)

    @staticmethod
    def _layer_bytes(sizes: StepBytes) -> int:
        # what a layer holds once read (an unwritten merge's tensors merged: each merge admitted on its own)
        return max(sizes.layers)

    def _merged_peak(self, stream: ModelStream, tokens: Sequence[Sequence[int]], steps: dict[str, int]) -> int | None:
        """A merge never written's largest step with its merges (None: a stored model's, or the sum of the
        largest step and the largest merge where that is not known better)."""
        if self.merged is None:
            return None
        from resumerge.analyses.evaluation.unwrittenneeds import merged_need

        return merged_need(stream, self.merged.merge, tokens, steps["heads"])

    def _budget(self, states: int, steps: dict[str, int], layers_here: bool, peak: int | None) -> int:
        """The budget of a pass holding ``states`` beside its largest step (``peak``; None: the largest of ``steps``,
        the heads' alone where the layers run on a Ray node, beside an unwritten merge's largest merge); refused
        (UsageError, exit 2) where they do not fit it."""
        # beside a step, an unwritten merge's read merges one tensor at a time (admitted by its governor)
        merging = self.merged.merge_bytes if self.merged is not None else 0
        largest = max(steps.values()) if layers_here else steps["heads"]
        return budget_fitting("the evaluation", states + (largest + merging if peak is None else peak),
                              self.settings.max_memory, SystemProbe())

    def _locked(self, workdir: Path, kind: str, requests: int, states: int, steps: dict[str, int],
                scored: Callable[[Reserve, Callable[[int | None], None]], Found], layers_here: bool = True,
                peak: int | None = None) -> Found:
        """A pass in ``workdir``, its lock held, its steps admitted by the memory governor under the budget
        (refused, exit 2, before its first layer where ``states`` and its largest step do not fit: ``peak``, or
        where None the largest of ``steps`` and an unwritten merge's largest merge), its progress written for
        ``status``. ``layers_here`` False: the layers run on a Ray node, only the heads here."""
        self.workdir = workdir
        lock = pass_lock(workdir, f"this evaluation of {self.model.path}", self.command,
                         hint="wait for it to finish (run again, it answers from its journal), or stop it (it "
                              "resumes at the layer it reached)")
        lock.acquire()
        try:
            budget = self._budget(states, steps, layers_here, peak)
            gpu = self.settings.pass_device().budget("the evaluation", steps, states)  # None on the CPU, on Ray
            with Admission(budget, steps, gpu=gpu) as reserve:
                def on_layer(layer: int | None) -> None:
                    self._say(workdir, EvalStep(self.model.path, self.settings.tasks, kind, requests, layer,
                                                self.stream.layers))

                found = scored(reserve, on_layer)
            if self.step is not None:
                self._say(workdir, self.step, done=True)
            return found
        finally:
            lock.release()

    def _on_ray(self, sizes: StepBytes) -> Callable[[Callable[[int], None]], AbstractContextManager[Placement]]:
        """The cluster joined and the pass's actor placed (refused, exit 2, where no node holds it), before any
        weight is read: how :func:`~.scorer.score` starts it."""
        from resumerge.analyses.check.onray import actor_bytes, ray_models
        from resumerge.analyses.onray import ray_places

        assert self.ray is not None
        where = ray_places(self.ray[0], actor_bytes(sizes)[:1], what="evaluation")
        keep = self.ray[1]
        given = None if self.state.given is None else str(self.state.root)  # --state-dir, as a node opens it

        def placed(told: Callable[[int], None]) -> AbstractContextManager[Placement]:
            return ray_models([replace(self.model, role="model")], where, self.stream.layers,
                              lambda layer, nodes: told(layer), state=given, keep=keep)

        return placed

    def _say(self, workdir: Path, step: EvalStep, done: bool = False) -> None:
        self.step = step
        doc = {"target": step.target, "model": _where(self.model), "tasks": list(step.tasks), "pass": step.kind,
               "requests": step.requests, "layer": step.layer, "layers": step.layers, "pid": os.getpid(),
               "command": self.command, "done": done}
        write_file_atomic(workdir / PROGRESS_NAME, (json.dumps(doc) + "\n").encode())
        if self.watcher is not None and not done:
            self.watcher(step)

    def where(self) -> str:
        """Where the evaluation stopped, in words (empty before its first layer)."""
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


def _generation(target: str, model: PassModel, weights: Weights, settings: EvalSettings, state: StateDir,
                command: str, watcher: Watcher | None, scorer: _Scorer, stream: ModelStream) -> Generation:
    """How the evaluation's generation tasks generate (:class:`~.streamgen.Generation`): journaled beside its
    passes, told to ``watcher`` as its passes are, its proof's lines with theirs."""
    def told(step: GenStep) -> None:
        if watcher is not None:
            watcher(EvalStep(target, settings.tasks, "generate_until", step.requests, step.layer, step.layers,
                             step.step, step.steps, step.plan))

    return Generation(model, weights, settings,
                      lambda digest: state.evals_dir / _key(model, "generate_until", digest, scorer.merged), command,
                      lambda: _fits(stream, settings), told, scorer.inputs, said=scorer.said)


def _fits(stream: ModelStream, settings: EvalSettings) -> bool:
    """Whether the whole model fits the budget (a greedy generation then holds it: :mod:`.generate`)."""
    try:
        _fits_whole(stream, ["the generation"], settings)
    except UsageError:
        return False
    return True


def _fits_streamed(stream: ModelStream, generating: list[str], settings: EvalSettings) -> None:
    """Refuse (exit 2, one line naming them) generation tasks whose least step, one decoder layer or the head, does
    not fit the budget: they could not run even one layer at a time."""
    from resumerge.analyses.evaluation.genplan import least_bytes

    try:
        budget_fitting("the generation tasks", least_bytes(stream), settings.max_memory, SystemProbe())
    except UsageError as exc:
        raise UsageError(f"{', '.join(generating)} generate text (generate_until), one decoder layer at a time "
                         f"where the whole model does not fit; {exc.message}", hint="raise --max-memory, or leave "
                         "those tasks out") from None


def _fits_whole(stream: ModelStream, generating: list[str], settings: EvalSettings) -> None:
    """Refuse (exit 2, one line naming them) generation tasks where the whole model does not fit the budget: they
    hold every layer for the whole generation."""
    try:
        budget_fitting("the generation tasks", resident_bytes(stream), settings.max_memory, SystemProbe())
        settings.pass_device().budget("the generation tasks", {"model": resident_bytes(stream)}, 0)
    except UsageError as exc:
        raise UsageError(f"{', '.join(generating)} generate text (generate_until), which holds the whole model; "
                         f"{exc.message}", hint="raise --max-memory, or leave those tasks out: the others run one "
                         "decoder layer at a time") from None


def eval_command(target: str, settings: EvalSettings, state: StateDir, merge_words: tuple[str, ...] = ()) -> str:
    """The shell command of this evaluation (what continues an interrupted one; ``merge_words``: the flags that
    merge a merge config TARGET)."""
    words = ["resumerge", "eval", target, *settings.command_words(), *merge_words]
    if settings.max_memory is not None:
        words += ["--max-memory", str(settings.max_memory)]
    if not is_default_state_root(state.given):
        words += ["--state-dir", os.fspath(state.root)]
    return shlex.join(words)


def is_config(target: str) -> bool:
    """Whether ``target`` is a merge config (a YAML file), evaluated as the merge it describes, unwritten."""
    return Path(target).suffix in _CONFIG_SUFFIXES and Path(target).is_file()


def _pass_model(target: str, unwritten: UnwrittenMerge | None, state: StateDir) -> tuple[PassModel, Weights]:
    """The model an evaluation's passes read and its weights: TARGET opened (refused in one line when it is not a
    model), or the merge ``unwritten`` describes; transformers required either way, before any weight is read."""
    if unwritten is None:
        _not_a_config(target)
        model = open_for_pass(target, "TARGET", state)
        weights = Weights.of(model.opened.directory, model.opened.tensors, model.remote)
    else:
        model = PassModel("merge", target, None, unwritten.opened)
        weights = Weights.of(unwritten.directory, unwritten.tensors, source=unwritten.source)
    require_transformers(_NEEDS, load=False)
    return model, weights


def _not_a_config(target: str) -> None:
    """A merge config reaches :func:`run_eval` opened (``unwritten``), never by its path."""
    if is_config(target):
        raise UsageError(f"TARGET {target} is a merge config", hint="evaluate it through resumerge.api.evaluate")


def _tokenizer(model: PassModel, chat: bool) -> Any:
    """The model's tokenizer, loaded as lm-eval's ``hf`` model loads it (transformers' ``AutoTokenizer``), or,
    without a chat template (``chat``), read without transformers where that gives the same tokens and texts
    (:func:`~.evaltok.eval_tokenizer`)."""
    directory = model.opened.directory
    if not ((directory / "tokenizer_config.json").is_file() or (directory / "tokenizer.json").is_file()):
        raise UsageError(f"TARGET {model.path} has no tokenizer", hint="copy the tokenizer files into its folder")
    if not chat:
        from resumerge.analyses.evaluation.evaltok import eval_tokenizer

        plain = eval_tokenizer(directory)
        if plain is not None:
            return plain
    transformers = require_transformers(_NEEDS)
    try:
        return tokenizer_at(transformers, directory)
    except (OSError, ValueError) as exc:
        raise UsageError(f"TARGET {model.path}: its tokenizer cannot be loaded: {exc}",
                         hint="copy a working tokenizer into its folder") from None


def _max_length(model: PassModel, tokenizer: Any) -> int:
    """The model's context as lm-eval's ``hf`` model resolves it (its config's, else its tokenizer's)."""
    from lm_eval.models.utils import resolve_max_length

    config = dict(model.opened.config)
    text = config.get("text_config")
    found = SimpleNamespace(**(text if isinstance(text, dict) else config))
    return int(resolve_max_length(found, tokenizer))  # type: ignore[arg-type]


def _where(model: PassModel) -> str:
    """The model as ``status`` finds it: a hub repo as named, a local path absolute."""
    return model.path if model.remote else os.path.abspath(model.path)


def _key(model: PassModel, kind: object, digest: str, merged: _Merged | None) -> str:
    """The content key of a pass: the model's files' identities (an unwritten merge's: its plan's fingerprint),
    the pass's kind (a text task's: with its parent's files) and tokens (``digest``), the batch size and the
    versions of the code that computes it."""
    versions = [importlib.metadata.version(d) for d in ("transformers", "resumerge", "torch")]
    doc = [_where(model),
           [[f.name, f.size, f.identity] for f in model.opened.files], kind, digest, BATCH_TOKENS, versions]
    if merged is not None:
        doc.append(merged.fingerprint)
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def _float32() -> Any:
    from resumerge.torch_import import torch

    return torch.float32

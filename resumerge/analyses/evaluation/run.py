"""An evaluation from start to end: the settings and the tasks checked, the model opened (headers only), its
tokenizer, then lm-eval's evaluation (:mod:`.harness`) with :class:`~.lm.ResumergeLM` as the model, each of whose
passes is scored on the forward engine under the memory budget and journaled under the state dir (``evals/<key>``: a
killed evaluation run again resumes each pass where it stopped and ends with the same results); then the outputs
written as lm-eval's CLI writes them (:mod:`.outputs`). Each pass is a job the pass driver runs (:mod:`.job`:
its folder locked, answered from its cache, fitted, placed where the executor put it, its Ctrl-C line said).

Everything that can be refused is refused before any weight is read: the settings, a merge config as TARGET, a
TARGET that is not a model, an unknown task or one whose dataset cannot be loaded, and a pass whose largest step
does not fit the budget (before its first layer). A generation task holds the whole model where it fits, else runs
one decoder layer at a time for all its requests (:mod:`.streamgen`), judged before its first weight is read."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from resumerge.analyses.evaluation.genconfig import processors_of
from resumerge.analyses.evaluation.generate import resident_bytes
from resumerge.analyses.evaluation.job import EvalPasses, EvalProgress, EvalStep, Merged, Watcher, pass_key
from resumerge.analyses.evaluation.placed import eval_layers
from resumerge.analyses.evaluation.report import EvalReport
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.streamgen import Generation, GenStep, generated_by
from resumerge.analyses.evaluation.tasks import TaskIndex, generation_tasks, loaded_tasks
from resumerge.analyses.evaluation.textwork import add_text_task, no_lm_tasks, text_work
from resumerge.analyses.evaluation.yamltasks import yaml_text_tasks
from resumerge.config.locations import StateDir, is_default_state_root
from resumerge.config.passplace import HERE, PassPlace
from resumerge.errors import InterruptedMerge, UsageError
from resumerge.forward.engine.reader import Weights
from resumerge.forward.engine.requires import Needs, require_transformers
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.proof import merge_inputs
from resumerge.forward.opening.opened import PassModel, open_for_pass
from resumerge.forward.text.texts import tokenizer_at
from resumerge.machine.memory import SystemProbe, budget_fitting
from resumerge.machine.memory.allocator import tune_allocator
from resumerge.machine.memory.cuda import is_gpu, normalise_device

if TYPE_CHECKING:
    from resumerge.merge.engine.unwritten import UnwrittenMerge

_CONFIG_SUFFIXES = (".yml", ".yaml")
_NEEDS = Needs("resumerge eval", hint="pip install transformers lm-eval (in the resumerge clone: pip install -c "
               "constraints.txt -e '.[eval]')")


def run_eval(target: str, settings: EvalSettings, *, state: StateDir, watcher: Watcher | None = None,
             unwritten: UnwrittenMerge | None = None, placement: PassPlace = HERE,
             task_index: TaskIndex | None = None, merge_words: tuple[str, ...] = ()) -> EvalReport:
    """Evaluate the model at ``target`` (a folder, a GGUF file, ``hf://`` repo) on ``settings``' tasks and return
    lm-eval's results; ``unwritten``: ``target`` is a merge config, opened as the merge it describes (each tensor
    merged when read, never written). ``placement``: where the executor placed the passes
    (:mod:`resumerge.config.passplace`): here, or each pass's decoder layers on an actor of a Ray cluster (check's
    :mod:`~resumerge.forward.placing.rayactor`), its head here: the same results, journaled alike (:mod:`.placed`).
    Each pass is a job the pass driver runs (:mod:`.job`). ``task_index``: lm-eval's task index shared with other
    evaluations (a search's candidates; None: one of its own). ``merge_words``: the flags that merge ``unwritten``
    as it was opened (in the command that continues). Raises :class:`UsageError` (exit 2) for anything refused
    before a weight is read, and :class:`InterruptedMerge` (exit 3) on Ctrl-C, naming the command that
    continues."""
    # the layers run on a Ray node, not this machine's GPU
    layers = eval_layers(placement)
    layers.site.refuse("the evaluation", settings.device, is_gpu(normalise_device(settings.device)))
    settings = settings.checked()
    if unwritten is not None:
        layers.refuse_unwritten()
    model, weights = _pass_model(target, unwritten, state)
    manager = (task_index or TaskIndex()).manager(settings) if settings.lm_tasks else None
    # Loaded once: checked here, the same objects run by lm-eval (None: no lm-eval task named).
    loaded = loaded_tasks(settings, manager) if manager is not None else None
    if loaded is not None:
        settings = replace(settings, yaml_texts=yaml_text_tasks(loaded, settings.lm_tasks))
    # What lm-eval runs (None: no task, or every name a text task's YAML: lm-eval runs none)
    runs = loaded.runs(settings) if loaded is not None and settings.lm_tasks else None
    generating = generation_tasks(loaded.kinds) if loaded is not None else []
    tokenizer = target_tokenizer(model, bool(settings.apply_chat_template))
    texts = [text_work(task, model, state) for task in settings.text_tasks]  # parents opened, texts tokenized
    command = eval_command(target, settings, state, merge_words)
    stream = ModelStream(weights, model.opened.config, _float32(), what="resumerge eval", key="TARGET",
                         device=settings.pass_device().name)
    restore_allocator = tune_allocator()
    # what a merge never written reads of its inputs, proved with each pass's journal as the model's own files are
    inputs = merge_inputs([unwritten.plan], state) if unwritten is not None else ([], [])
    progress = EvalProgress(target, model, settings.tasks, command, watcher)
    passes = EvalPasses(stream, model, settings, state, progress, layers, Merged.of(unwritten), inputs)
    with evaluating(stream, restore_allocator, progress, command):
        from resumerge.analyses.evaluation.lm import ResumergeLM

        layers.refuse_generating(generating)
        if generating:
            _fits_streamed(stream, generating, settings)  # before any weight is read
            _honoured(generating, loaded)
            processors_of(model.opened.directory)  # its generation_config.json: a setting not honoured, exit 2
        # the whole model held where it fits, else one layer at a time for every request (.streamgen)
        generation = _generation(target, model, weights, settings, state, command, watcher, passes, stream)
        lm = ResumergeLM(tokenizer, target_max_length(model, tokenizer), passes,
                         generator=generated_by(generation, lambda: lm) if generating else None)
        results, tracker = _evaluate(lm, target, settings, runs) if runs is not None else \
            no_lm_tasks(target, settings)
        for work in texts:
            add_text_task(results, work, passes.texts(work))
    from resumerge.analyses.evaluation.outputs import write_outputs

    written = write_outputs(results, tracker, settings, target) if tracker is not None else ()
    return EvalReport(target=target, results=results, written=written, proof="; ".join(passes.said) or None)


@contextmanager
def evaluating(stream: ModelStream, restore_allocator: Callable[[], None] | None, progress: EvalProgress,
               command: str) -> Iterator[None]:
    """An evaluation's work on ``stream`` (its own, or an open model's for a caller's lm-eval): Ctrl-C said as
    where it stopped and ``command`` (exit 3), the stream closed and the allocator put back however it ends."""
    try:
        yield
    except KeyboardInterrupt:  # outside a pass (lm-eval's own work): in one, the pass driver says where it stopped
        raise InterruptedMerge(progress.stopped(), resume_command=command) from None
    finally:
        stream.close()
        if restore_allocator is not None:
            restore_allocator()


def _evaluate(lm: Any, target: str, settings: EvalSettings, runs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """lm-eval's evaluation of the tasks ``runs`` (:meth:`~.tasks.LoadedTasks.runs`) with ``lm`` as the model, as
    its CLI runs it for these options but the machine's description (:mod:`.harness`), and the tracker that writes
    its files (None without ``output_path``)."""
    from lm_eval.loggers import EvaluationTracker

    from resumerge.analyses.evaluation.harness import evaluate_tasks

    tracker = EvaluationTracker(output_path=settings.output_path) if settings.output_path is not None else None
    return evaluate_tasks(lm, target, settings, runs, tracker), tracker


def _generation(target: str, model: PassModel, weights: Weights, settings: EvalSettings, state: StateDir,
                command: str, watcher: Watcher | None, passes: EvalPasses, stream: ModelStream) -> Generation:
    """How the evaluation's generation tasks generate (:class:`~.streamgen.Generation`): journaled beside its
    passes, told to ``watcher`` as its passes are, its proof's lines with theirs."""
    def told(step: GenStep) -> None:
        if watcher is not None:
            watcher(EvalStep(target, settings.tasks, "generate_until", step.requests, step.layer, step.layers,
                             step.step, step.steps, step.plan))

    def folder(digest: str) -> Path:
        return state.evals_dir / pass_key(model, "generate_until", digest, passes.merged)

    return Generation(model, weights, settings, folder, command, lambda: _fits(stream, settings), told, passes.inputs,
                      said=passes.said)


def _fits(stream: ModelStream, settings: EvalSettings) -> bool:
    """Whether the whole model fits the budget (a generation then holds it: :mod:`.generate`)."""
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


def _honoured(generating: list[str], loaded: Any) -> None:
    """Refuse (exit 2, one line naming it) a generation task's generation kwarg that resumerge does not honour,
    before any weight is read (:func:`~.genrequests.honoured`; sampling is honoured)."""
    from resumerge.analyses.evaluation.genrequests import honoured

    for name in generating:
        honoured(loaded.task(name).config.generation_kwargs or {}, f"{name}'s generation_kwargs")


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


def target_tokenizer(model: PassModel, chat: bool) -> Any:
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


def target_max_length(model: PassModel, tokenizer: Any) -> int:
    """The model's context as lm-eval's ``hf`` model resolves it (its config's, else its tokenizer's)."""
    from lm_eval.models.utils import resolve_max_length

    config = dict(model.opened.config)
    text = config.get("text_config")
    found = SimpleNamespace(**(text if isinstance(text, dict) else config))
    return int(resolve_max_length(found, tokenizer))  # type: ignore[arg-type]


def _float32() -> Any:
    from resumerge.machine.torch_import import torch

    return torch.float32


__all__ = ["EvalStep", "Watcher", "eval_command", "is_config", "run_eval"]

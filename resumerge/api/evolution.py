"""The work of ``resumerge evolve CONFIG STORAGE`` (:func:`resumerge.api.evolve`): every refusal made before any
weight is read (the config, the options, the genome's headers, the first candidate planned as ``run`` plans it,
STORAGE's owner), then the search (:mod:`resumerge.runs.evolve.search`) with its candidates merged by :func:`run`'s own
code, and ``merge_best`` written as ``run`` writes a merge."""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from resumerge.api.options import Harness, Output, PathLike, Resources, Settings, config_text
from resumerge.config.locations import StateDir
from resumerge.config.passplace import HERE, PassPlace
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.report import EvalReport
    from resumerge.analyses.evaluation.settings import EvalSettings
    from resumerge.analyses.evaluation.tasks import TaskIndex
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executors import Executor
    from resumerge.merge.engine.unwritten import Population
    from resumerge.merge.plan.merge_plan import Plan
    from resumerge.runs.evolve.objective import ScoresGeneration
    from resumerge.runs.evolve.options import SearchOptions
    from resumerge.runs.evolve.progress import Watcher
    from resumerge.runs.evolve.search import Planned
    from resumerge.runs.evolve.shapes.genome import ShapeSpec
    from resumerge.runs.evolve.shapes.scoring import LmAsked
    from resumerge.runs.evolve.storage import Evaluated, Say
    from resumerge.runs.evolve.tracking import Tracking


@dataclass(frozen=True)
class EvolveOutcome:
    """A finished search: its ``storage``, the ``best`` candidate (its generation, index, genotype, merge config,
    objective and task figures), the generations run, and ``merged`` (the run that wrote it where ``merge_best``
    was given)."""

    storage: Path
    best: Evaluated
    generations: int
    merged: Outcome | None = None
    shape: str | None = None  # a structure search's best, in words (``repeat 8-11``), of ``candidates`` scored
    candidates: int = 0
    front: Path | None = None  # a structure search's size/score Pareto front (its file)


@dataclass(frozen=True)
class ApiCalls:
    """The API's own calls a search makes, handed in by :mod:`resumerge.api.calls` (which imports this module, so
    this one cannot import it): ``run`` merges a candidate (and ``merge_best``), ``plan_merge`` plans the first,
    ``open_population`` opens a generation unwritten, ``evaluate`` scores its lm-eval tasks."""

    run: Callable[..., Outcome]
    plan_merge: Callable[[str], Plan]
    open_population: Callable[..., Population]
    evaluate: Callable[..., EvalReport]


@dataclass(frozen=True)
class SearchAsked:
    """A search as the front door resolved it: the mergekit-evolve ``config``, its ``store`` (STORAGE), CMA-ES's
    ``options``, the ``resources`` each candidate is merged and scored within, the ``state`` dir (resolved once, at
    the front door: the parents' small files, the kl tasks' texts' tokens), ``merge_best`` (where the best candidate
    is then written), ``allow_benchmark_tasks``, lm-eval's ``task_search_path``; ``placement``
    (:mod:`resumerge.config.passplace`) on Ray: each generation's candidates spread over the nodes of that cluster
    (:mod:`resumerge.runs.evolve.spread`), STORAGE on a path every node sees; ``executor``: what writes ``merge_best``
    (:func:`resumerge.api.run`'s); ``tracking``: where the search is logged (W&B, trackio:
    :mod:`resumerge.runs.evolve.tracking`)."""

    config: PathLike
    store: Path
    options: SearchOptions
    resources: Resources
    state: StateDir
    merge_best: PathLike | None = None
    allow_benchmark_tasks: bool = False
    task_search_path: PathLike | None = None
    placement: PassPlace = HERE
    executor: Executor | None = None
    tracking: Sequence[Tracking] = ()
    output: Output = Output()  # how merge_best is written (its format: safetensors, or GGUF of a type)


def evolve_into(asked: SearchAsked, calls: ApiCalls, *, written: bool = False,
                progress: Watcher | None = None) -> EvolveOutcome:
    """:func:`resumerge.api.evolve`'s work, with the API's own calls handed in (``calls``: this module sits under
    the front door's package). Each generation is scored in one streamed pass per task
    (:class:`~resumerge.runs.evolve.streamed.StreamedCandidates`), or, ``written``, each candidate merged to disk and
    scored alone (:class:`~resumerge.runs.evolve.written.WrittenCandidates`: the reference the streamed figures are held
    to). ``progress``: told each step of the search (a candidate's pass at each layer, each candidate scored, the
    best so far and the time left). Each tracking library (``asked.tracking``) is imported before anything is
    read."""
    from resumerge.analyses.evaluation.tasks import TaskIndex
    from resumerge.forward.engine.device import PassDevice
    from resumerge.forward.job.threads import pass_threads
    from resumerge.runs.evolve import storage as files
    from resumerge.runs.evolve.combined import is_combined
    from resumerge.runs.evolve.genome import tokenizer_model
    from resumerge.runs.evolve.lmeval import LmEvalCandidates, eval_settings
    from resumerge.runs.evolve.progress import SearchProgress
    from resumerge.runs.evolve.search import run_search
    from resumerge.runs.evolve.shapes.genome import is_structure
    from resumerge.runs.evolve.streamed import StreamedCandidates
    from resumerge.runs.evolve.together import Together
    from resumerge.runs.evolve.tracking import SearchLog, backend
    from resumerge.runs.evolve.written import WrittenCandidates

    text = config_text(asked.config)
    _refuse_output(asked)
    if is_structure(text):
        return _evolve_structure(asked, calls, text)
    if is_combined(text):
        return _evolve_combined(asked, calls, text, progress)
    store, resources, merge_best, run = asked.store, asked.resources, asked.merge_best, calls.run
    if resources.max_disk is not None:
        raise UsageError("--max-disk bounds a structure genome's cache; a parameter genome keeps none",
                         hint="leave out --max-disk")
    backends = [(each.kind, backend(each)) for each in asked.tracking]  # a library missing: exit 2 before anything
    include = os.fspath(asked.task_search_path) if asked.task_search_path is not None else None
    on = PassDevice.of(resources.device).name  # the scoring passes run where the merges do (refused first)
    index = TaskIndex()  # lm-eval's tasks indexed once: for the planning and every candidate's evaluation
    planned, plan = plan_evolve(asked.config, asked.options, asked.allow_benchmark_tasks, calls.plan_merge,
                                asked.state, include, resources.device, index)
    if resources.max_memory is not None:
        _fits(planned, plan, resources.max_memory)
    if merge_best is not None and Path(merge_best).resolve().is_relative_to(store.resolve()):
        raise UsageError(f"--merge-best {merge_best} is inside STORAGE", hint="write the best merge elsewhere")
    files.claim(store, planned.identity())

    def merge(text: str, out: Path, state: Path) -> StateDir:
        run(text, out, Settings(output=Output(write_model_card=False), resources=resources, state_dir=state))
        return StateDir.resolve(state)  # the candidate's scoring passes read its run's state as run resolved it

    source = tokenizer_model(planned.spec.genome)
    tokenizer = Path(source) if source is not None else None

    def population(texts: Sequence[str]) -> Population:
        return calls.open_population(texts, Settings(resources=resources, state_dir=store / files.WORK / "state"))

    tasks = planned.spec.tasks
    settings = eval_settings(planned.spec, include, resources.device) if any(t.kind == "lm-eval" for t in tasks) \
        else None

    def evaluated(target: Path, settings: EvalSettings, state: Path) -> dict[str, Any]:
        harness = Harness(include_path=settings.include_path, limit=settings.limit,
                          num_fewshot=settings.num_fewshot, apply_chat_template=settings.apply_chat_template)
        given = Settings(resources=Resources(max_memory=resources.max_memory, device=settings.device),
                         state_dir=state)
        return dict(calls.evaluate(target, settings.tasks, given, harness=harness, task_index=index).results)

    command = evolve_command(asked)

    def scorer_at(root: Path, say: Say | None = None) -> ScoresGeneration:
        """The search's scorer, its passes journaled and its texts' tokens kept in ``root``, telling ``say`` where
        it is (None: ``root``'s progress file alone; a Ray node's scorer, which this process's watcher never
        reaches)."""
        own: ScoresGeneration = WrittenCandidates(root, tasks, merge, tokenizer, on, say) if written else \
            StreamedCandidates(root, tasks, population, tokenizer, asked.state, _bytes(resources.max_memory),
                               on, say, command)
        parts = [("own", own)] if any(t.kind != "lm-eval" for t in tasks) else []
        if settings is not None:
            parts.append(("lm-eval", LmEvalCandidates(root, tasks, settings, evaluated, say)))
        return parts[0][1] if len(parts) == 1 else Together(root, parts)

    told = SearchProgress(store, progress)
    with files.locked(store, command), ExitStack() as closing:
        # Every candidate scored with the thread count the search first started with (its bits depend on it), on
        # this machine or on the one it is resumed on; each pass records it as its own (forward.threads).
        closing.enter_context(pass_threads(store / files.THREADS))
        logs = [SearchLog(store, kind, each, planned.identity()) for kind, each in backends]
        for log in logs:
            closing.callback(log.close)
        scorer = _scoring(asked.placement, scorer_at, store, told.say)
        best = run_search(planned, store, scorer, told, command, logs)
    merged = _merge_best(asked, run)
    return EvolveOutcome(store, best, len(files.read_state(store)), merged)


def _evolve_structure(asked: SearchAsked, calls: ApiCalls, text: str) -> EvolveOutcome:
    """A structure genome's search (:mod:`resumerge.runs.evolve.shapes`): every refusal first (the genome, the
    options it does not take, its first edit planned as ``run`` plans it, STORAGE's owner), then the base's cache
    and the search in one pass of the pass driver, then ``merge_best`` written as ``run`` writes it."""
    import yaml

    from resumerge.forward.job.driver import PassFolder, drive
    from resumerge.runs.evolve import storage as files
    from resumerge.runs.evolve.options import SearchOptions
    from resumerge.runs.evolve.shapes.scoring import CACHE, Budgets, ShapeJob
    from resumerge.runs.evolve.shapes.search import FRONT, ShapeSearch, figure_of, plan_shapes, read_measured
    from resumerge.runs.evolve.storage import Evaluated

    options, store, resources, merge_best = asked.options, asked.store, asked.resources, asked.merge_best
    plain = SearchOptions()
    if (options.popsize, options.sigma0, options.random_seed) != (plain.popsize, plain.sigma0, plain.random_seed):
        raise UsageError("--popsize, --sigma0 and --random-seed are CMA-ES's: a structure genome is searched by a "
                         "scan and a beam", hint="set beam_width, beam_depth and beam_edits in the genome")
    if asked.tracking or asked.placement != HERE:
        raise UsageError("a structure search runs in this process, logged to its STORAGE alone",
                         hint="leave out --wandb, --trackio and --executor ray")
    plan = plan_shapes(text, asked.state, asked.allow_benchmark_tasks)
    lm = _lm_tasks(asked, plan.spec)  # known, loadable, none generating: before anything is written
    scan = plan.scan()
    first = calls.plan_merge(yaml.safe_dump(plan.config(scan[min(1, len(scan) - 1)]), sort_keys=False))
    dtypes = {t.out_dtype for t in first.tensors.values()}  # what run writes every candidate's layers in
    if merge_best is not None and Path(merge_best).resolve().is_relative_to(store.resolve()):
        raise UsageError(f"--merge-best {merge_best} is inside STORAGE", hint="write the best merge elsewhere")
    files.claim(store, plan.identity())
    command = evolve_command(asked)
    files.say(store, pid=os.getpid(), command=command, finished=False, kind="structure")

    def say(**where: Any) -> None:
        files.say(store, **where)

    def search(scorer: Any) -> Any:
        return ShapeSearch(plan, store, scorer, say).run()

    folder = PassFolder(store / CACHE, f"the structure search's pass in {store}", command,
                        hint="wait for the search to end", threads=store / files.THREADS)
    budgets = Budgets(_bytes(resources.max_memory), _bytes(resources.max_disk))
    with files.locked(store, command):
        best = drive(ShapeJob(folder, plan.spec.genome.model, (*plan.spec.tasks, *plan.spec.held_out),
                              asked.state, store / files.TOKENS, search, budgets, resources.device or "cpu", say,
                              plan.spec.genome.sources, lm, dtypes.pop() if len(dtypes) == 1 else None))
    files.say(store, finished=True, phase=None, candidates=[])
    merged = _merge_best(asked, calls.run)
    found = Evaluated(1, best.number - 1, [], plan.config(best.shape), figure_of(plan.spec.tasks, best.tasks),
                      best.tasks)
    return EvolveOutcome(store, found, 1, merged, best.shape.key, len(read_measured(store)), store / FRONT)


def _evolve_combined(asked: SearchAsked, calls: ApiCalls, text: str, progress: Watcher | None) -> EvolveOutcome:
    """A parameter search, then a structure search over its best merge (:mod:`resumerge.runs.evolve.combined`):
    every refusal of both stages first (the structure block read against the parameter models' layers), then each
    stage as its own search in STORAGE's folders, then ``best.yml`` (the combined recipe) and ``merge_best``."""
    import yaml

    from resumerge.errors import ConfigError
    from resumerge.machine.durable import write_file_atomic
    from resumerge.runs.evolve import combined
    from resumerge.runs.evolve import storage as files
    from resumerge.runs.evolve.options import SearchOptions
    from resumerge.runs.evolve.shapes.genome import read_shape_spec

    store = asked.store
    merged = store.resolve() / combined.MERGED
    params, shape = combined.stage_texts(text, merged)
    try:
        spec = read_shape_spec(shape, allow_benchmarks=asked.allow_benchmark_tasks)
    except ConfigError as error:
        raise combined.in_structure(error) from None
    if asked.tracking or asked.placement != HERE:
        raise UsageError("a combined search runs in this process, logged to its STORAGE alone",
                         hint="leave out --wandb, --trackio and --executor ray")
    if asked.merge_best is not None and Path(asked.merge_best).resolve().is_relative_to(store.resolve()):
        raise UsageError(f"--merge-best {asked.merge_best} is inside STORAGE", hint="write the best merge elsewhere")
    include = os.fspath(asked.task_search_path) if asked.task_search_path is not None else None
    planned, _ = plan_evolve(params, asked.options, asked.allow_benchmark_tasks, calls.plan_merge, asked.state,
                             include, asked.resources.device or "cpu")
    repeat = spec.genome.repeat
    if repeat is not None and repeat[1] >= planned.layers:
        raise ConfigError(f"layer {repeat[1]} is past the merge's last, {planned.layers - 1}",
                          yaml_path=f"{combined.STRUCTURE}.repeat")
    files.claim(store, {"kind": "combined", "config": combined.fingerprint(text), "parameters": planned.identity()})
    command = evolve_command(asked)
    files.say(store, pid=os.getpid(), command=command, finished=False, kind="combined")
    configs = [store / f"{name}.yml" for name in (combined.PARAMETERS, combined.STRUCTURE)]
    with files.locked(store, command):
        files.sweep(store)  # the temp files a killed start left beside best.yml and the stages' configs
        for path, each in zip(configs, (params, shape)):
            write_file_atomic(path, each.encode())
        first = evolve_into(replace(asked, config=configs[0], store=store / combined.PARAMETERS,
                                    merge_best=merged, output=Output(),
                                    resources=replace(asked.resources, max_disk=None)), calls, progress=progress)
        second = evolve_into(replace(asked, config=configs[1], store=store / combined.STRUCTURE, merge_best=None,
                                     output=Output(), options=SearchOptions()), calls)
        found = combined.recipe(first.best.config, second.best.config, spec.genome.model)
        head = (f"# resumerge evolve (parameters, then structure): {second.shape} over the parameter search's best, "
                f"objective {second.best.objective!r}\n")
        write_file_atomic(store / files.BEST, (head + yaml.safe_dump_all(found, sort_keys=False)).encode(),
                          point="during_best_write")
    files.say(store, finished=True)
    return replace(second, storage=store, merged=_merge_best(asked, calls.run))


def _lm_tasks(asked: SearchAsked, spec: ShapeSpec) -> list[LmAsked]:
    """The structure search's lm-eval tasks, the searched ones and the held-out ones each scored together, every
    one refused (exit 2) where lm-eval does not know it, cannot load it, or it generates."""
    from resumerge.analyses.evaluation.tasks import TaskIndex
    from resumerge.runs.evolve.lmeval import refuse_unscorable
    from resumerge.runs.evolve.shapes.lmtasks import lm_settings

    include = os.fspath(asked.task_search_path) if asked.task_search_path is not None else None
    index = TaskIndex()
    found: list[LmAsked] = []
    for tasks in (spec.tasks, spec.held_out):
        chosen = tuple(t for t in tasks if t.kind == "lm-eval")
        if chosen:
            settings = lm_settings([t.name for t in chosen], include, spec.limit, spec.num_fewshot,
                                   spec.apply_chat_template, asked.resources.device or "cpu")
            refuse_unscorable(settings, index)
            found.append((chosen, settings, index))
    return found


def _merge_best(asked: SearchAsked, run: Callable[..., Outcome]) -> Outcome | None:
    """``best.yml`` written into ``merge_best`` as :func:`run` writes it, in the output format asked (None: not
    asked)."""
    if asked.merge_best is None:
        return None
    from resumerge.runs.evolve import storage as files

    return run(asked.store / files.BEST, asked.merge_best, Settings(
        output=asked.output, resources=asked.resources, executor=asked.executor, state_dir=asked.state.given))


def _refuse_output(asked: SearchAsked) -> None:
    """An output format asked without ``merge_best`` (nothing it would apply to), or a GGUF type ``run`` would
    refuse, refused before the search (exit 2)."""
    from dataclasses import fields

    from resumerge.api.ggufoptions import gguf_options

    if asked.merge_best is None and asked.output != Output():
        raise UsageError("--out-type and --gguf-type say how --merge-best is written", hint="add --merge-best OUT")
    gguf_options({each.name: getattr(asked.output, each.name) for each in fields(Output)})


class _MakesScorer(Protocol):
    """Makes the scorer that keeps its passes in ``root``, telling ``say`` where it is (None: its files alone)."""

    def __call__(self, root: Path, say: Say | None = None) -> ScoresGeneration: ...


def _scoring(placement: PassPlace, make: _MakesScorer, store: Path, say: Say) -> ScoresGeneration:
    """What scores a generation where ``placement`` runs the search's passes: this process scores every candidate
    with the scorer ``make`` makes of ``store`` where its site runs the layers here; else each generation's
    candidates are spread over the nodes of the cluster it names, each group scored there."""
    from resumerge.forward.placing.sites import site_of

    if site_of(placement).here:
        return make(store, say)
    from resumerge.runs.evolve.spread import SpreadOverNodes

    return SpreadOverNodes(make, store, placement.address, placement.keep, say, placement.stream)


def evolve_command(asked: SearchAsked) -> str:
    """The shell command of the search ``asked`` (what continues an interrupted one: the same settings, or STORAGE
    refuses it; ``--state-dir`` where it is not the default; where it is logged, so the continued search logs on to
    the same run: W&B's and trackio's keys stay in their environment variables and login files, never in it)."""
    from resumerge.config.locations import is_default_state_root
    from resumerge.forward.placing.sites import site_of
    from resumerge.runs.evolve.spec import OPT_IN

    options, resources, merge_best = asked.options, asked.resources, asked.merge_best
    words = ["resumerge", "evolve", os.fspath(asked.config), os.fspath(asked.store), "--max-fevals",
             str(options.max_fevals)]
    if options.popsize is not None:
        words += ["--popsize", str(options.popsize)]
    if options.sigma0 != 1 / 6:
        words += ["--sigma0", repr(options.sigma0)]
    if options.random_seed != 0:
        words += ["--random-seed", str(options.random_seed)]
    if resources.max_memory is not None:
        words += ["--max-memory", str(resources.max_memory)]
    if resources.max_disk is not None:
        words += ["--max-disk", str(resources.max_disk)]
    if resources.device not in (None, "cpu"):
        words += ["--device", str(resources.device)]
    if not is_default_state_root(asked.state.given):
        words += ["--state-dir", os.fspath(asked.state.root)]
    words += site_of(asked.placement).words()
    if merge_best is not None:
        words += ["--merge-best", os.fspath(merge_best)]
    if asked.output.out_type != Output().out_type:
        words += ["--out-type", asked.output.out_type]
    if asked.output.gguf_type != Output().gguf_type:
        words += ["--gguf-type", asked.output.gguf_type]
    if asked.allow_benchmark_tasks:
        words.append(OPT_IN)
    if asked.task_search_path is not None:
        words += ["--task-search-path", os.fspath(asked.task_search_path)]
    for each in asked.tracking:
        words += [f"--{each.kind}", f"--{each.kind}-project", each.project]
        if each.entity is not None:
            words += [f"--{each.kind}-entity", each.entity]
    return shlex.join(words)


def plan_evolve(config: PathLike, options: SearchOptions, allow_benchmark_tasks: bool,
                plan_merge: Callable[[str], Plan], state: StateDir, include_path: str | None = None,
                device: str = "cpu", index: TaskIndex | None = None) -> tuple[Planned, Plan]:
    """The search :func:`evolve_into` would run and its first candidate's plan, every refusal made (reading headers
    only, and the tokenizers of a kl parent whose vocabulary differs from the candidates': its texts' tokens kept in
    the ``state`` dir, as ``eval`` keeps them; nothing else written); ``index``: lm-eval's task index, kept for the
    candidates' evaluations."""
    from resumerge.runs.evolve.models import genome_layers
    from resumerge.runs.evolve.search import plan_search
    from resumerge.runs.evolve.spec import read_spec

    if options.popsize is not None and options.popsize < 2:
        raise UsageError(f"--popsize {options.popsize}: CMA-ES needs two candidates a generation or more")
    if options.max_fevals < 1:
        raise UsageError(f"--max-fevals {options.max_fevals}: a search needs one evaluation or more")
    if not (math.isfinite(options.sigma0) and options.sigma0 > 0):
        raise UsageError(f"--sigma0 {options.sigma0}: the first step size must be a positive number")
    spec = read_spec(config_text(config), allow_benchmarks=allow_benchmark_tasks)
    if any(t.kind == "lm-eval" for t in spec.tasks):  # known, loadable, none generating: before any weight
        from resumerge.runs.evolve.lmeval import eval_settings, refuse_unscorable

        refuse_unscorable(eval_settings(spec, include_path, device), index)
    layers = genome_layers(spec, state)
    planned = plan_search(spec, layers, options)
    import yaml

    # The first candidate planned as run plans it: a method's own refusal (a parameter, a base) comes now.
    plan = plan_merge(yaml.safe_dump(planned.config_of(planned.settings.x0), sort_keys=False))
    if any(t.kind == "kl" for t in spec.tasks):  # a parent of another vocabulary: can it meet the candidates'?
        from resumerge.runs.evolve.vocabs import refuse_unmet

        refuse_unmet(spec, plan.out_config, state)
    return planned, plan


def _bytes(max_memory: int | str | None) -> int | None:
    """``--max-memory`` in bytes (None: not given)."""
    from resumerge.machine.memory.sizes import parse_size

    return parse_size(max_memory) if isinstance(max_memory, str) else max_memory


def _fits(planned: Planned, plan: Plan, max_memory: int | str) -> None:
    """Refuse (exit 2) a generation whose streamed pass would not fit ``max_memory`` (judged from the first
    candidate's plan and the tasks' texts; a genome whose tokenizer is a hub model's is judged when it runs)."""
    import json

    from resumerge.merge.engine.unwritten import generation_bytes, largest_popsize
    from resumerge.runs.evolve.budget import hidden_bytes, refuse_past_budget
    from resumerge.runs.evolve.genome import tokenizer_model
    source = tokenizer_model(planned.spec.genome)
    if source is None:
        return
    budget = _bytes(max_memory)
    assert budget is not None
    config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    hidden = hidden_bytes(planned.spec, Path(source), config)
    refuse_past_budget(planned.spec, planned.popsize, hidden, budget,
                       lambda popsize, each: generation_bytes([plan], popsize, each),
                       lambda room, each: largest_popsize([plan], room, each))

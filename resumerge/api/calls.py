"""The API's calls that run something: ``run``, ``resume``, ``extract_lora``, ``estimate_extraction``, ``check``,
``evaluate``, ``measure``, ``estimate_measure``, ``plan_merge``, ``estimate`` and ``evolve`` (each documented where
:mod:`resumerge.api` re-exports it, here). The package imports this module on the first use of one of them, so that
``status`` and ``verify`` (:mod:`.reading`) never pay for the option groups and the kinds of run.

Every function takes its options as a few frozen groups (:mod:`.options`: :class:`Output`, :class:`Merging`,
:class:`Resources`, :class:`Hub`, :class:`Stages`, :class:`Lora`) and turns them into the
:class:`~resumerge.merge.plan.merge_plan.PlanOptions` that change output bytes and the
:class:`~resumerge.config.settings.RunSettings` that do not, then hands the call to its kind of run: a single
merge, a recipe (several YAML documents), MoE upcycling (a mergekit-moe config) or a LoRA extraction, each one
class (:mod:`.runkind`) in the one tuple :data:`~resumerge.api.kinds.KINDS` walked here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from resumerge.api.evolution import EvolveOutcome
from resumerge.api.importance import computed_imatrix
from resumerge.api.keywords import one_spelling
from resumerge.api.kinds import EXTRACTION, killed_account, kind_of, own_record, planner_of, recorded_kind
from resumerge.api.options import (
    Harness,
    Lora,
    PathLike,
    Search,
    Settings,
    Trackers,
    config_text,
    nothing_started,
    nothing_written,
    pass_placement,
    pass_settings,
    plan_options,
    recorded_device,
    settings_for,
    started_early,
    stop_flag,
    taken,
    usable_device,
)
from resumerge.api.reading import named
from resumerge.api.runkind import Call
from resumerge.api.unwritten import open_population
from resumerge.config.locations import StateDir
from resumerge.config.settings import RunSettings
from resumerge.machine.memory.sizes import parse_size
from resumerge.merge.plan.defaults import DEFAULT_SHARD_SIZE
from resumerge.runs.extract.spec import ExtractSpec

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from resumerge.analyses.check import CheckReport
    from resumerge.analyses.check.progress import Step as CheckStep
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.analyses.evaluation import EvalReport
    from resumerge.analyses.evaluation.run import EvalStep
    from resumerge.analyses.evaluation.tasks import TaskIndex
    from resumerge.analyses.measure.run import MeasureEstimate, MeasureReport
    from resumerge.inputs.codecs import CodecTable
    from resumerge.merge.engine.drive import Outcome
    from resumerge.merge.engine.executor import Reporter
    from resumerge.merge.plan.merge_plan import Plan
    from resumerge.runs.evolve.progress import SearchStep
    from resumerge.runs.evolve.tracking import Tracking
    from resumerge.runs.recipes.estimate import RecipeEstimate


@one_spelling
def run(
    config: PathLike,
    out: PathLike,
    settings: Settings = Settings(),
    *,
    restart: bool = False,
    progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None,
    codecs: CodecTable | None = None,
    check: bool = False,
) -> Outcome:
    """Merge ``config`` into ``out``, like ``resumerge run``. ``config`` is a YAML file (a ``Path``, or a ``str``
    naming one) or YAML text (a ``str`` holding a newline or a one-line YAML mapping); the same holds for every
    ``config`` parameter here. ``settings`` (:class:`~resumerge.api.options.Settings`, one frozen object a notebook
    builds once and passes to every call) holds the options in groups: what OUT holds (``output``), how models are
    merged (``merging``), what the run may use (``resources``), how an ``hf://`` OUT is written (``hub``), a
    recipe's stages (``stages``), the ``state_dir`` and the ``executor``; ``restart`` starts over an earlier,
    different run into ``out``.

    ``settings.executor`` computes the output shards: None or ``LocalExecutor()`` this process; ``RayExecutor(address,
    keep_workers)`` (``--executor ray --ray-address --keep-workers``, from :mod:`resumerge.merge.engine.executors`) a
    worker per node of the Ray cluster at ``address`` (default: ``RAY_ADDRESS``, else a Ray started for the run; OUT and
    the inputs must be paths every node sees); the bytes are the same whichever computes, and a run started with one
    resumes with another. On a cluster that outlives the run (``address``, ``RAY_ADDRESS``, or one this process is
    connected to) Ray's workers stay for the next run, idle for at most ``keep_workers`` seconds (600 by default;
    ``0``: they end with the run), holding no CPU while idle.

    A multi-document ``config`` is a recipe (mergekit-multi): its named stages go where ``stages`` says; the final
    stage's outcome is returned. With an ``hf://`` OUT only the final stage is committed to the repo, with the
    recipe's record. A single merge is refused (exit 4) into a recipe's OUT, even with ``restart``: it would leave
    the recipe's record stale.

    ``out`` may be ``"hf://NAMESPACE/NAME[@BRANCH]"``: the merge goes to that hub repo (as ``settings.hub`` says)
    in shards of about 1/100 of the output by default (25 MB to 1 GB), at most ``resources.max_disk`` bytes
    uncommitted.

    A mergekit-moe config (``base_model`` and ``experts``) is upcycled into a mixture of experts, as
    ``mergekit-moe`` does.

    ``progress`` is a reporter the caller made (the CLI hands in its display,
    :class:`~resumerge.cli.render.ProgressReporter`), used as given (the caller closes it); ``True`` is deprecated.
    ``should_stop`` is polled at safe points: once true, the run stops and raises InterruptedMerge (exit 3).
    ``codecs`` is the table of stored formats a merge config's models are recognised by (None: every format
    resumerge decodes, :data:`~resumerge.inputs.codecs.CODECS`); a notebook adds its own format with
    ``CodecTable((*CODECS.formats, MyCodec))``. A resume reuses the plan recorded with the run while no input
    changed; planned again, it recognises the default formats.

    ``check`` (``--check``) checks the merged model against its base and parents once the merge is done, as
    :func:`check` does (under the same ``state_dir`` and ``max_memory``): the outcome is then a
    :class:`~resumerge.api.checked.CheckedOutcome` whose ``check`` is the report (``resumerge run --check`` exits
    with its verdict's code). Only a merge or a recipe into a local OUT can be checked; anything else is refused
    before the run starts.
    """
    named(out)
    output, merging, stages = settings.output, settings.merging, settings.stages
    # A Ray run's workers start first: they import while this process imports and plans.
    with started_early(settings_for(settings, "run"), out, settings.resources.device) as running:
        from resumerge.merge.plan.sharding import shard_size_choice

        text = config_text(config)
        kind = kind_of(text)
        if output.imatrix_texts is not None and kind.name != "merge":  # its pass runs before a single merge's run
            from resumerge.api.options import source_name
            from resumerge.errors import UsageError

            raise UsageError(f"--imatrix-texts computes the importance matrix of a single merge, and "
                             f"{source_name(config, 'the config')} is a {kind.name} config",
                             hint="merge it first, then give --imatrix the matrix measure --imatrix writes of it")
        options = computed_imatrix(plan_options(output, merging, settings.resources,
                                                out_shard_size=shard_size_choice(output.out_shard_size, out)[0]),
                                   text, running.state)
        # OUT's locations (state dir, run dir, ledger), resolved once and handed down with the call.
        where = running.state.run(out)
        call = Call(config, text, out, options, running, allow_same_experts=merging.allow_same_experts, where=where,
                    codecs=codecs)
        from resumerge.merge.engine.reporting import Driving  # the engine's, imported by a run alone

        driving = Driving(stop_flag(should_stop), restart=restart, intermediate_dir=stages.intermediate_dir,
                          cleanup=stages.cleanup_intermediates)
        if check:  # imported here: status must not import the engine (api.checked's Outcome)
            from resumerge.api.checked import refuse_check

            refuse_check(kind.name, out)
        with nothing_started(where):
            kind.check(call, driving)
            outcome = kind.run(call, replace(driving, reporter=_reporter(progress)))
    if not check:
        return outcome
    from resumerge.api.checked import checked

    return checked(outcome, state=running.state, max_memory=running.max_memory, executor=running.executor,
                   reporter=_reporter(progress))

@one_spelling
def resume(
    out: PathLike,
    settings: Settings = Settings(),
    *,
    progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None,
) -> Outcome:
    """Finish the merge recorded for ``out``, like ``resumerge resume`` (for a recipe: every stage still to do,
    returning the final stage's outcome); an ``hf://`` OUT resumes from the repo alone. ``settings`` mean what they
    mean for :func:`run` (what a run records, its output and merging groups, its device and how it reads its inputs,
    is refused here); none of
    them changes the output, so they may differ from the first run's — but ``num_threads``: a run whose methods'
    bytes depend on it (slerp, karcher, model_stock, nuslerp) reuses the recorded count, and a different one is
    refused (UsageError)."""
    named(out)
    from resumerge.merge.engine.reporting import Driving  # the engine's, imported by a run alone

    driving = Driving(stop_flag(should_stop), _reporter(progress), cleanup=settings.stages.cleanup_intermediates)
    given = settings_for(settings, "resume")
    # A Ray run's workers, while this one reads its record: none for a GPU plan (they start without one), nor where
    # only the hub's manifest says the device.
    with started_early(given, out, recorded_device(out, given)) as running:
        where = running.state.run(out)  # resolved once: the recorded kind and the engine take it as is
        own = own_record(where)
        if own is not None:
            return own.resume_own(where, running, driving)
        from resumerge.api.analyses import kept
        from resumerge.errors import NothingRecordedError
        from resumerge.merge.engine.session import resuming

        # What the run recorded, read once; the kind it names (or, for a run recorded before kinds were, the one
        # its text is) resumes it; a model card it rebuilt gets the last check's section back.
        try:
            with resuming(where, running, driving.reporter) as recorded:
                outcome = recorded_kind(recorded.kind, recorded.text).resume(recorded, running, driving)
        except NothingRecordedError as exc:  # a run killed while planning: its kind says what it had done
            raise killed_account(exc, where) from None
        return kept(outcome, running.state)  # what the analyses wrote into OUT (a check's card section)

@one_spelling
def extract_lora(
    model: str, base_model: str, out: PathLike, settings: Settings = Settings(), *, lora: Lora = Lora(),
    restart: bool = False, plan: bool = False, progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None, fresh_process: bool = False,
) -> Outcome | Estimate:
    """Extract a PEFT LoRA adapter of ``model`` (the fine-tune) against ``base_model`` into ``out``, like
    ``resumerge extract-lora`` (``lora``: mergekit-extract-lora's options and meanings). Journaled like a merge:
    :func:`resume` finishes it. ``settings`` mean what they mean for :func:`run` (of ``output`` only
    ``write_model_card`` applies: an adapter is one file; no ``stages``, no ``executor``). Each module's factors are
    kept in the state dir until the adapter is committed, then deleted here.

    ``plan=True`` returns :func:`estimate_extraction`'s estimate instead (``fresh_process`` as there), writing
    nothing; call that function for it, which always returns an estimate.
    """
    call = _extraction_call(_spec(model, base_model, lora), out, settings, settings_for(settings, "extract_lora"))
    if plan:
        return _estimate_extraction(call, fresh_process)
    named(out)
    from resumerge.merge.engine.reporting import Driving  # the engine's, imported by a run alone

    driving = Driving(stop_flag(should_stop), restart=restart)
    call = replace(call, where=call.settings.state.run(out))  # resolved once, handed down with the call
    with nothing_started(call.locations):
        EXTRACTION.check(call, driving)
        return EXTRACTION.run(call, replace(driving, reporter=_reporter(progress)))


@one_spelling
def estimate_extraction(
    model: str, base_model: str, out: PathLike, settings: Settings = Settings(), *, lora: Lora = Lora(),
    fresh_process: bool = False,
) -> Estimate:
    """Validate the LoRA extraction that :func:`extract_lora` would run with these options (they mean what they
    mean there) and return its :class:`~resumerge.analyses.estimate.costs.Estimate`, as :func:`estimate` does for a
    merge (``fresh_process`` as there; ``resumerge extract-lora --plan``), writing nothing."""
    call = _extraction_call(_spec(model, base_model, lora), out, settings,
                            settings_for(settings, "estimate_extraction"))
    return _estimate_extraction(call, fresh_process)

@one_spelling
def check(model: PathLike, settings: Settings = Settings(), *, base: PathLike | None = None,
          parents: Sequence[PathLike] = (), prompts: PathLike | None = None, truncate_texts: bool = False,
          progress: Callable[[CheckStep], None] | None = None) -> CheckReport:
    """Does the merge in ``model`` work, like ``resumerge check``: a static pass over its tensors and a forward
    pass, one decoder layer of one model at a time, of it, its ``base`` and its ``parents`` (a resumerge
    output's come from its record when none is given) over built-in texts or ``prompts`` (a file, one text per
    line); the report's ``verdict`` is works, no_effect or broken, its ``exit_code`` 0, 5 or 6. Journaled per
    layer under ``settings.state_dir``: a killed check resumes at the layer it reached, with the same report. Any
    model may be a hub repo, the string ``"hf://NAMESPACE/NAME[@REVISION]"``, read by byte range, or a GGUF file
    (its config and tokenizer rebuilt from its metadata into the state dir). A resumerge output's model card gets
    the check's section (recorded, so ``verify`` passes); ``report.card`` says what became of it. ``settings``: the
    object :func:`run` takes; of its ``resources`` a check honours ``max_memory``, the whole process's budget,
    ``device`` and ``max_gpu_memory`` (below), and refuses the others set, as it refuses ``output``, ``merging``,
    ``hub`` and ``stages``. ``settings.executor``: None or ``LocalExecutor()`` runs the models one after another in
    this process; ``RayExecutor(address)`` each model's pass on a node of its own of that Ray cluster (the same
    report; a check started with one resumes with the other). A text longer than the models' context
    (``max_position_embeddings``) is refused naming its line, before any layer runs, or cut to the context with
    ``truncate_texts``. Models whose vocabularies differ are compared over the tokens they share
    (``report.shared_tokens``, ``report.vocabulary``); models that share none, or a text holding a token one lacks,
    are refused before any layer runs.
    ``progress`` is told each step (a :class:`~resumerge.analyses.check.progress.Step`: the phase, the layer, the
    model running, the tokens). Interrupted (Ctrl-C), it raises :class:`~resumerge.errors.InterruptedMerge` naming
    the layer reached, whose ``resume_command`` is the command that continues it. ``Resources(device="cuda")``: each
    decoder layer moved to the GPU while it runs, the hidden states kept there (a model larger than the GPU's memory
    runs on it), each step admitted by ``max_gpu_memory`` too (None: most of what the GPU has free); the same figures
    to float32's rounding, and a check started on one device resumes on the other (a GPU here and Ray's executor
    together are refused, exit 2)."""
    from resumerge.analyses.check.job import CheckSettings
    from resumerge.analyses.check.run import CheckAsked, run_check
    from resumerge.forward.engine.device import PassDevice

    given = pass_settings("check", settings)
    asked = CheckAsked(model, base, tuple(parents), prompts, truncate_texts)
    return run_check(asked, CheckSettings(state=given.state, max_memory=given.max_memory,
                                          placement=pass_placement(given),
                                          device=PassDevice.of(settings.resources.device, given.max_gpu_memory),
                                          default_state=StateDir.resolve(None)), progress)


@one_spelling
def evaluate(target: PathLike, tasks: Sequence[str] | str, settings: Settings = Settings(), *,
             harness: Harness = Harness(), progress: Callable[[EvalStep], None] | None = None,
             task_index: TaskIndex | None = None) -> EvalReport:
    """lm-evaluation-harness ``tasks`` (names, or a comma-separated string; YAMLs from ``harness.include_path`` too)
    on the model ``target`` (a folder, a GGUF file, ``"hf://NAMESPACE/NAME[@REVISION]"``, or a merge config: the
    merge it describes, each tensor merged in memory by ``run``'s method code as its layer runs, never written), like
    ``resumerge eval``: lm-eval builds the requests and computes the metrics, resumerge scores every request of a
    pass one decoder layer at a time within ``settings.resources.max_memory``, journaled under
    ``settings.state_dir`` (a killed evaluation run again resumes with the same results). ``check``'s figures are
    tasks too: ``nll:FILE`` (NLL per token of FILE's texts) and ``kl:PARENT:FILE`` (KL from the model PARENT on
    them), in the results as ``nll,none`` and ``kl,none``.

    ``harness`` (:class:`~resumerge.api.options.Harness`) holds lm-eval's options: ``include_path``, ``limit``,
    ``num_fewshot``, ``apply_chat_template``, ``log_samples``, ``output_path`` and ``seed`` (its four seeds; a
    sampled generation task draws from the torch one, the same answers on every run and resume).
    ``report.results`` is lm-eval's results object as ``simple_evaluate`` returns it, but for the description of
    the machine (torch's ``collect_env``, 1.2 s): ``harness.output_path``: written there as lm-eval's CLI writes it,
    that description included (with each task's samples where ``log_samples``).

    ``settings`` (:class:`~resumerge.api.options.Settings`, the object :func:`run` takes): of its ``resources`` an
    evaluation honours ``max_memory``, ``device`` and ``max_gpu_memory`` (where the layers run, as for
    :func:`check`; a GPU here, not with Ray's executor); ``merging``: how a merge config ``target`` is merged
    (``random_seed``, ``allow_crimes``, ``unsafe_truncate_embeddings``), as :func:`run` merges it, refused for a
    model ``target``; ``state_dir`` keeps the journal; ``executor``: None or ``LocalExecutor()`` runs every layer in
    this process, ``RayExecutor(address)`` each pass's decoder layers on an actor of that Ray cluster, the head here
    (the same results; an evaluation started with one resumes with the other; a merge config and generation tasks
    are refused there, exit 2). Its ``output``, ``hub`` and ``stages`` (an evaluation writes no run) and the other
    resources are refused set (exit 2).

    ``progress`` is told each layer of each pass. ``task_index``
    (:class:`~resumerge.analyses.evaluation.tasks.TaskIndex`): lm-eval's index of its tasks, built at its first use
    and reused by every call given it (indexing lm-eval's own task YAMLs costs ~8 CPU s; None: built for this call).
    Bad input (an unknown task, a dataset not available offline, ``limit`` 0, a generation kwarg it does not
    honour) raises :class:`~resumerge.errors.UsageError` before any weight is read; Ctrl-C raises
    :class:`~resumerge.errors.InterruptedMerge` naming the command that continues."""
    from resumerge.api.evaluation import evaluate_with

    return evaluate_with(target, tasks, settings, settings_for(settings, "evaluate"), harness, progress=progress,
                         task_index=task_index)


@one_spelling
def measure(config: PathLike, out: PathLike, settings: Settings = Settings(), *, texts: PathLike | None = None,
            progress: Callable[[str], None] | None = None, truncate_texts: bool = False,
            imatrix: PathLike | None = None) -> MeasureReport:
    """Record, like ``resumerge measure``, the Gram matrix of every linear's input for every model of ``config`` over
    calibration ``texts`` (a file, one text per line; default: built-in texts) into the folder ``out``, for a
    ``regmean`` merge (``parameters: {grams: out}``). Any model may be a local folder, a hub repo (read by byte range)
    or a GGUF file. One decoder layer at a time, each admitted by the RAM governor under
    ``settings.resources.max_memory`` (``settings`` is the object :func:`run` takes; of its resources a measurement
    honours the memory budget and ``device``/``max_gpu_memory``, where the layers run, as for :func:`check`), journaled
    per layer under ``settings.state_dir``: a killed measurement run again resumes at the layer it reached and writes
    the same bytes. ``settings.executor``: None or ``LocalExecutor()`` measures the models one after another in this
    process; ``RayExecutor(address)`` each model's pass in an actor on a node of that Ray cluster, the models side by
    side (the same bytes; a measurement started with one resumes with the other; a ``regmean_plus`` config's merged pass
    is refused there). ``progress`` is told each layer as it starts. A text longer than the models' context is refused
    naming its line, before anything is written, or cut to the context with ``truncate_texts`` (as ``check`` does).
    ``imatrix``: a file the Grams are also written to as llama.cpp's importance matrix (llama-imatrix's GGUF: each
    linear's sums of squared inputs, the diagonal of its Gram times the tokens, named as llama.cpp names the weight;
    several models' sums pooled), for ``--imatrix`` of a GGUF run or llama-quantize."""
    from resumerge.analyses.measure.run import MeasureSettings, measure_grams
    from resumerge.forward.engine.device import PassDevice

    given = pass_settings("measure", settings)
    measuring = MeasureSettings(given.max_memory, given.state, pass_placement(given),
                                PassDevice.of(settings.resources.device, given.max_gpu_memory))
    return measure_grams(config, out, texts=texts, on_progress=progress, cut_texts=truncate_texts,
                         settings=measuring, imatrix=imatrix)


@one_spelling
def estimate_measure(config: PathLike, settings: Settings = Settings(), *, texts: PathLike | None = None,
                     truncate_texts: bool = False) -> MeasureEstimate:
    """What :func:`measure` of ``config`` over ``texts`` needs under ``resources.max_memory``, like ``resumerge
    measure --plan``: each model's decoder layers and the memory of its pass, the smallest budget that fits and
    whether the budget does (``.fits``, ``.lines()``); reads headers and the texts, writes nothing. The options mean
    what they mean for :func:`measure` (``executor`` is checked, as :func:`estimate` checks it: Ray's without Ray
    installed is refused; the budget is this process's, which holds every layer of a local measurement)."""
    from resumerge.analyses.measure.run import estimate_measure as estimated

    given = pass_settings("estimate_measure", settings)
    pass_placement(given)
    return estimated(config, texts=texts, max_memory=given.max_memory, cut_texts=truncate_texts, state=given.state)


@one_spelling
def plan_merge(config: PathLike, settings: Settings = Settings(), *, codecs: CodecTable | None = None) -> Plan:
    """Validate ``config`` against the models' headers and return the frozen plan (shards of ``out_shard_size``,
    1 GB when not given); writes nothing (a mergekit-moe config's hidden-state routers are not computed). Of
    ``settings`` a plan honours ``output``, ``merging`` and ``state_dir`` (where a computed importance matrix is
    kept). ``codecs``: as for :func:`run`."""
    taken(settings, "plan_merge")
    output, merging = settings.output, settings.merging
    shard_size = DEFAULT_SHARD_SIZE if output.out_shard_size is None else output.out_shard_size
    options = plan_options(output, merging, out_shard_size=shard_size)  # the options refused before the config is read
    text = config_text(config)
    options = computed_imatrix(options, text, StateDir.resolve(settings.state_dir))
    call = Call(config, text, None, options, RunSettings(), allow_same_experts=merging.allow_same_experts,
                codecs=codecs)
    return planner_of(kind_of(text)).plan(call)


@one_spelling
def estimate(
    config: PathLike,
    out: PathLike | None = None,
    settings: Settings = Settings(),
    *,
    probe_size: int | str = "32MiB",
    bandwidth: str | None = None,
    session: str | None = None,
    disk_free: Callable[[Path], int] | None = None,
    fresh_process: bool = False,
) -> Estimate | RecipeEstimate:
    """Validate ``config`` and estimate disk, downloads, peak RAM and time of merging it into ``out``, like
    ``resumerge plan CONFIG OUT``; ``.fits`` and ``.reasons`` give the verdict, ``.to_json()`` the document
    ``plan --json`` prints. Writes nothing but the disk probe's temp file (deleted; ``probe_size=0`` skips it).

    ``settings`` mean what they mean for :func:`run` (``executor`` is checked, not timed; no ``hub``): compute is
    timed on ``resources.device`` with ``resources.num_threads`` threads (a GPU this machine lacks is refused, exit
    2). ``out`` may be an ``hf://`` target and ``resources.max_disk`` bounds the local disk. A multi-document
    ``config`` is a recipe: every stage is estimated (a :class:`~resumerge.runs.recipes.estimate.RecipeEstimate`),
    which needs ``out`` to place them (``stages.intermediate_dir`` as for :func:`run`). ``disk_free`` replaces the
    free-space reading (tests simulate small disks with it); ``fresh_process`` says this process was started for
    this estimate, as the merge's will be (the CLI), so its age counts as the merge's start-up. Raises the same
    errors as :func:`plan_merge` for an invalid merge; a merge that does not fit is not an error.

    A merge with hub inputs or an ``hf://`` OUT gets a network estimate (``.network``, none for a recipe): bytes
    each way at ``bandwidth`` (``"DOWN[/UP]"`` per second, e.g. ``"150MB/75MB"``) or at a download rate measured by
    two range reads (``probe_size=0`` skips them), and the pipelined run's wall time with what bounds it.
    ``session`` (a length, ``"12h"``) asks how many notebook sessions of that length the merge takes
    (``.session``).
    """
    from resumerge.analyses.estimate.measuring import Measuring
    from resumerge.analyses.estimate.network import parse_bandwidth
    from resumerge.analyses.estimate.sessions import parse_duration
    from resumerge.machine.diskprobe import free_bytes
    from resumerge.merge.plan.sharding import shard_size_choice

    if out is not None:
        named(out)
    given = settings_for(settings, "estimate")
    output = settings.output
    link = parse_bandwidth(bandwidth) if bandwidth is not None else None
    length = parse_duration(session) if session is not None else None
    # The estimate plans without the thread count (as it always has): its fingerprint is the config's own.
    options = plan_options(output, settings.merging, settings.resources, num_threads=None,
                           out_shard_size=shard_size_choice(output.out_shard_size, out)[0])
    options = computed_imatrix(options, config_text(config), given.state)
    usable_device(options.device)
    measuring = Measuring(probe_bytes=parse_size(probe_size, option="--probe-size"),
                          disk_free=disk_free or free_bytes, bandwidth=link)
    text = config_text(config)
    call = Call(config, text, out, options, given, allow_same_experts=settings.merging.allow_same_experts)
    with nothing_written():
        result = kind_of(text).estimate(call, measuring, fresh_process=fresh_process,
                                        intermediate_dir=settings.stages.intermediate_dir)
    from resumerge.runs.recipes import estimate as recipes

    if isinstance(result, recipes.RecipeEstimate):  # a plan per stage, each with its own shard size
        return result
    # The plan says why, when it chose the shard size.
    return replace(result, shard_choice=shard_size_choice(output.out_shard_size, out)[1],
                   session=result.sessions_of(length) if length is not None else None)


def _spec(model: str, base_model: str, lora: Lora) -> ExtractSpec:
    """The extraction asked: ``lora``'s options, each an :class:`ExtractSpec` field of the same name."""
    given: dict[str, Any] = {each.name: getattr(lora, each.name) for each in fields(lora)}
    return ExtractSpec(model=model, base_model=base_model, **given)


def _extraction_call(spec: ExtractSpec, out: PathLike, asked: Settings, settings: RunSettings) -> Call:
    """The call of the extraction ``spec`` into ``out`` (its recorded text is the spec's; one adapter file, no
    tokenizer)."""
    from resumerge.runs.extract.spec import spec_text

    options = plan_options(asked.output, asked.merging, asked.resources, out_shard_size=DEFAULT_SHARD_SIZE,
                           copy_tokenizer=False)
    text = spec_text(spec)
    return Call(text, text, out, options, settings)


def _estimate_extraction(call: Call, fresh_process: bool) -> Estimate:
    from resumerge.analyses.estimate.measuring import Measuring

    with nothing_written():
        return EXTRACTION.estimate(call, Measuring(), fresh_process=fresh_process, intermediate_dir=None)


def _reporter(progress: bool | Reporter) -> Reporter | None:
    """The reporter of one call: the caller's own (the CLI hands in its display, and closes it), or None. The
    terminal's display is the CLI's to make: ``progress=True`` is deprecated and shows nothing."""
    if progress is True:
        warnings.warn("progress=True is deprecated and shows nothing: hand in a reporter, e.g. "
                      "progress=resumerge.cli.render.ProgressReporter() (close it after the call)",
                      DeprecationWarning, stacklevel=3)
    return None if isinstance(progress, bool) else progress


@one_spelling
def evolve(config: PathLike, storage: PathLike, settings: Settings = Settings(), *, search: Search = Search(),
           merge_best: PathLike | None = None, allow_benchmark_tasks: bool = False,
           task_search_path: PathLike | None = None, trackers: Trackers = Trackers(),
           progress: Callable[[SearchStep], None] | None = None) -> EvolveOutcome:
    """Search the merge parameters of the mergekit-evolve ``config`` with CMA-ES, like ``resumerge evolve``
    (``search``: :class:`~resumerge.api.options.Search`, ``popsize`` candidates a generation, None: cma's 4 + 3 ln
    n, ``max_fevals`` evaluations, first step ``sigma0``, draws seeded by ``random_seed``); everything kept in the
    folder ``storage`` (``evaluations.jsonl`` and ``.csv``, ``best.yml``, ``objective.png``). Killed anywhere, the
    same call resumes and ends with the same files. Each candidate is merged as :func:`run` merges (within
    ``settings.resources.max_memory``, on ``resources.device``, the only fields of :func:`run`'s resources a search
    honours; ``settings`` holds no merging, hub or stages options here, and of ``output`` only ``out_type`` and
    ``gguf_type``: how ``merge_best`` is written, a GGUF file as :func:`run` writes one) into a folder of
    its own under ``storage``, scored on its tasks (``{kl: {parent, texts}}``: KL from that parent on its own
    texts; ``{nll: {texts}}``), then removed. ``merge_best``: the best candidate is then written there as
    :func:`run` writes it. Task names of common benchmarks are refused unless ``allow_benchmark_tasks``, as
    mergekit-evolve refuses them. ``settings.executor`` (the object :func:`run` takes): None or ``LocalExecutor()``
    scores every candidate in this process; ``RayExecutor(address)`` spreads each generation's candidates over the nodes
    of that Ray cluster, each node scoring a group of them (the streamed pass: its node reads the parents' layers once
    for its group), ``storage`` on a path every node sees (the same files; a search started with one resumes with the
    other), and writes ``merge_best`` on it as :func:`run` does. The search ends after exactly ``search.max_fevals``
    evaluations (its last generation cut to what is left), or earlier where cma's own criteria stop it.
    ``progress``: told each step (:class:`~resumerge.runs.evolve.progress.SearchStep`: a generation begun, a pass's
    layer, a candidate scored, with the best objective so far and the time left), as ``resumerge evolve`` prints
    them on stderr.
    ``trackers`` (:class:`Trackers`: ``wandb``, mergekit-evolve's ``--wandb``, to
    ``wandb_project`` of ``wandb_entity``, and ``trackio``, to ``trackio_project``): the search logged there, a row
    per candidate (genotype, figures, objective), a summary per generation, ``best.yml`` as an artifact when the
    best changes; a resumed search logs to the same run, each candidate once (``logged-*.json`` in ``storage``).
    ``settings.state_dir``: as for :func:`run` (the parents' small files, the kl tasks' texts' tokens, ``merge_best``'s
    ledger); ``resumerge status STORAGE`` (:func:`status`) says where the search stands. A structure genome
    (``kind: structure``) searches a model's layer path instead; a parameter genome with a ``structure:`` block
    searches the parameters, then the layer path of their best merge (``search``: the parameter stage's;
    :mod:`resumerge.runs.evolve.combined`), ``best.yml`` the combined recipe ``merge_best`` is written from.

    Raises :class:`~resumerge.errors.ConfigError` or :class:`~resumerge.errors.UsageError` (exit 2) before any
    weight is read for a bad config or option, a genome of models of different shapes or a filter matching
    nothing, an lm-eval task unknown or not loadable offline, or a STORAGE holding another search."""
    from pathlib import Path

    from resumerge.api.evolution import ApiCalls, SearchAsked, evolve_into

    given = settings_for(settings, "evolve")  # the state dir resolved here, once
    asked = SearchAsked(config, Path(storage), search, settings.resources, given.state, merge_best,
                        allow_benchmark_tasks, task_search_path, pass_placement(given), settings.executor,
                        _tracking(trackers), settings.output)
    return evolve_into(asked, ApiCalls(run, plan_merge, open_population, evaluate), progress=progress)


def _tracking(trackers: Trackers) -> list[Tracking]:
    """Where :func:`evolve` logs its search (an entity or project named without its library: exit 2)."""
    from resumerge.errors import UsageError
    from resumerge.runs.evolve.tracking import Tracking

    if trackers.wandb_entity is not None and not trackers.wandb:
        raise UsageError("--wandb-entity needs --wandb", hint="add --wandb, or leave out --wandb-entity")
    found = [Tracking("wandb", trackers.wandb_project, trackers.wandb_entity)] if trackers.wandb else []
    return found + ([Tracking("trackio", trackers.trackio_project)] if trackers.trackio else [])


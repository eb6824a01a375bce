"""The front door: ``run``, ``resume``, ``status``, ``verify``, ``check``, ``estimate`` (what ``resumerge plan``
prints), ``plan_merge``, ``extract_lora`` and ``estimate_extraction``, for the CLI and for notebooks alike.

Each CLI command parses its arguments and makes one call here, so a notebook gets the very tool the README
describes. Every function takes flat keyword parameters and packs them (:mod:`.options`) into the
:class:`~resumerge.plan.merge_plan.PlanOptions` that change output bytes and the
:class:`~resumerge.config.settings.RunSettings` that do not, then hands the call to its kind of run: a single
merge, a recipe (several YAML documents), MoE upcycling (a mergekit-moe config) or a LoRA extraction, each one
class (:mod:`.runkind`) in the one tuple :data:`~resumerge.api.kinds.KINDS` walked here. Errors are the
:mod:`resumerge.errors` exceptions that the CLI maps to exit codes.

May import: errors, config, memory, methods, vocab, inputs, store, plan, outputs, moe, extract, engine, recipes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from resumerge.api.kinds import EXTRACTION, kind_of, own_record, planner_of, recorded_kind
from resumerge.api.options import (
    PathLike,
    config_text,
    hub_output,
    named,
    nothing_started,
    plan_options,
    recorded_device,
    run_settings,
    started_early,
    stop_flag,
    usable_device,
)
from resumerge.api.runkind import Call, Driving
from resumerge.config.settings import RunSettings
from resumerge.extract.spec import ExtractSpec
from resumerge.memory.sizes import parse_size
from resumerge.plan.defaults import DEFAULT_SEED, DEFAULT_SHARD_SIZE

__all__ = ["check", "estimate", "estimate_extraction", "extract_lora", "plan_merge", "recipe_status", "resume", "run",
           "status", "verify"]

# Only what ``status`` and ``verify`` need is imported here, so that they stay fast (no torch): the merging
# commands import the engine inside the function.
if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from resumerge.check import CheckReport
    from resumerge.engine.drive import Outcome
    from resumerge.engine.executor import Reporter
    from resumerge.engine.executors import Executor
    from resumerge.estimate.costs import Estimate
    from resumerge.inputs.codecs import CodecTable
    from resumerge.plan.merge_plan import Plan
    from resumerge.recipes.estimate import RecipeEstimate
    from resumerge.recipes.view import RecipeStatus
    from resumerge.store.integrity import VerifyReport
    from resumerge.store.statusview import StatusReport



def run(
    config: PathLike,
    out: PathLike,
    *,
    state_dir: PathLike | None = None,
    out_shard_size: int | str | None = None,
    random_seed: int = DEFAULT_SEED,
    restart: bool = False,
    copy_tokenizer: bool = True,
    allow_crimes: bool = False,
    allow_same_experts: bool = False,
    max_memory: int | str | None = None,
    device: str = "cpu",
    max_gpu_memory: int | str | None = None,
    staging: bool | PathLike | None = None,
    intermediate_dir: PathLike | None = None,
    cleanup_intermediates: bool = False,
    max_disk: int | str | None = None,
    public: bool = False,
    commit_every: int | None = None,
    commit_interval: float | None = None,
    stream_inputs: bool = False,
    write_model_card: bool = True,
    unsafe_truncate_embeddings: bool = False,
    dequantize: bool = False,
    out_type: str = "safetensors",
    gguf_type: str = "f16",
    out_adapter: bool = False,
    cache_dir: PathLike | None = None,
    num_threads: int | None = None,
    executor: Executor | None = None,
    progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None,
    codecs: CodecTable | None = None,
    check: bool = False,
) -> Outcome:
    """Merge ``config`` into ``out``, like ``resumerge run``. ``config`` is a YAML file (a ``Path``, or a ``str``
    naming one) or YAML text (a ``str`` holding a newline or a one-line YAML mapping); the same holds for every
    ``config`` parameter here.

    ``stream_inputs`` (``--stream-inputs``) reads every hub input's tensors by HTTP Range instead of downloading
    its files; by default a file is streamed when the merge needs less than half of it, or when downloading it
    would break ``max_disk``. ``cache_dir`` (``--transformers-cache``) is the Hugging Face cache for hub models;
    ``num_threads`` (``-j``) torch's thread count.

    ``executor`` computes the output shards: None or ``LocalExecutor()`` this process; ``RayExecutor(address,
    keep_workers)`` (``--executor ray --ray-address --keep-workers``, from :mod:`resumerge.engine.executors`) a worker
    per node of the Ray cluster at ``address`` (default: ``RAY_ADDRESS``, else a Ray started for the run; OUT and the
    inputs must be paths every node sees); the bytes are the same whichever computes, and a run started with one
    resumes with another. On a cluster that outlives the run (``address``, ``RAY_ADDRESS``, or one this process is
    connected to) Ray's workers stay for the next run, idle for at most ``keep_workers`` seconds (600 by default;
    ``0``: they end with the run), holding no CPU while idle.

    A multi-document ``config`` is a recipe (mergekit-multi): its named stages go to ``intermediate_dir``
    (default ``OUT.intermediates``, or under the state dir for an ``hf://`` OUT), deleted at the end with
    ``cleanup_intermediates``; the final stage's outcome is returned. With an ``hf://`` OUT only the final stage
    is committed to the repo, with the recipe's record. A single merge is refused (exit 4) into a recipe's OUT,
    even with ``restart``: it would leave the recipe's record stale.

    ``staging``: None stages files on local disk only when ``out`` is on Drive or another remote filesystem,
    True always, False never, or a local directory to stage in (``--staging-dir``).

    ``out`` may be ``"hf://NAMESPACE/NAME[@BRANCH]"``: the merge goes to that hub repo (created private unless
    ``public``) in shards of about 1/100 of the output by default (25 MB to 1 GB), each committed once uploaded
    (``commit_every`` files or ``commit_interval`` seconds batch them), at most ``max_disk`` bytes uncommitted.

    A mergekit-moe config (``base_model`` and ``experts``) is upcycled into a mixture of experts, as
    ``mergekit-moe`` does; ``allow_same_experts`` (``--i-understand-this-is-not-useful-without-training``) lets
    every expert be the same model, as there, and is refused for any other config.

    ``write_model_card=False`` (``--no-write-model-card``) writes no README.md and no mergekit_config.yml;
    ``unsafe_truncate_embeddings`` (``--unsafe-truncate-embeddings``) merges models whose vocabularies differ in
    size by keeping the common leading rows (config.json and the tokenizer are cut to match). ``dequantize``
    (``--dequantize``) stores every output tensor plainly in its dtype, whatever format the base model is stored in.
    ``out_type="gguf"`` (``--out-type gguf``) writes one GGUF file, ``model.gguf``, instead of safetensors shards,
    its matrices as ``gguf_type`` (``--gguf-type``: ``f16``, ``bf16``, ``q8_0``) and its tokenizer from a GGUF parent.
    ``out_adapter`` (``--out-adapter``) writes a ``core_space`` merge of LoRA adapters as one merged PEFT adapter
    (rank at most the adapters' summed ranks) instead of a merged model.

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
    settings = run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory,
                            max_gpu_memory=max_gpu_memory, staging=staging, max_disk=max_disk,
                            output=hub_output(public, commit_every, commit_interval), num_threads=num_threads,
                            executor=executor)
    # A Ray run's workers start first: they import while this process imports and plans.
    with started_early(settings, out, device) as settings:
        from resumerge.plan.sharding import shard_size_choice

        text = config_text(config)
        kind = kind_of(text)
        options = plan_options(out_shard_size=shard_size_choice(out_shard_size, out)[0], random_seed=random_seed,
                               copy_tokenizer=copy_tokenizer, device=device, allow_crimes=allow_crimes,
                               stream_inputs=stream_inputs, write_model_card=write_model_card, dequantize=dequantize,
                               out_type=out_type, gguf_type=gguf_type,
                               unsafe_truncate_embeddings=unsafe_truncate_embeddings, num_threads=num_threads,
                               out_adapter=out_adapter)
        call = Call(config, text, out, options, settings, allow_same_experts=allow_same_experts, codecs=codecs)
        driving = Driving(stop_flag(should_stop), restart=restart, intermediate_dir=intermediate_dir,
                          cleanup=cleanup_intermediates)
        if check:  # imported here: status must not import the engine (api.checked's Outcome)
            from resumerge.api.checked import refuse_check

            refuse_check(kind.name, out)
        with nothing_started(out, state_dir):
            kind.check(call, driving)
            outcome = kind.run(call, replace(driving, reporter=_reporter(progress)))
    if not check:
        return outcome
    from resumerge.api.checked import checked

    return checked(outcome, state_dir=state_dir, max_memory=settings.max_memory)


def resume(
    out: PathLike,
    *,
    state_dir: PathLike | None = None,
    max_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    staging: bool | PathLike | None = None,
    cleanup_intermediates: bool = False,
    max_disk: int | str | None = None,
    commit_every: int | None = None,
    commit_interval: float | None = None,
    num_threads: int | None = None,
    executor: Executor | None = None,
    progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None,
) -> Outcome:
    """Finish the merge recorded for ``out``, like ``resumerge resume`` (for a recipe: every stage still to do,
    returning the final stage's outcome); an ``hf://`` OUT resumes from the repo alone. The options mean what they
    mean for :func:`run`; none of them changes the output, so they may differ from the first run's — but
    ``num_threads``: a run whose methods' bytes depend on it (slerp, karcher, model_stock, nuslerp) reuses the
    recorded count, and a different one is refused (UsageError)."""
    named(out)
    settings = run_settings(state_dir=state_dir, max_memory=max_memory, max_gpu_memory=max_gpu_memory,
                            staging=staging, max_disk=max_disk, output=hub_output(False, commit_every,
                                                                                  commit_interval),
                            num_threads=num_threads, executor=executor)
    driving = Driving(stop_flag(should_stop), _reporter(progress), cleanup=cleanup_intermediates)
    # A Ray run's workers, while this one reads its record: none for a GPU plan (they start without one), nor where
    # only the hub's manifest says the device.
    with started_early(settings, out, recorded_device(out, settings)) as settings:
        own = own_record(out, settings.state_dir)
        if own is not None:
            return own.resume_own(out, settings, driving)
        from resumerge.engine.session import resuming

        # What the run recorded, read once; the kind it names (or, for a run recorded before kinds were, the one
        # its text is) resumes it.
        with resuming(out, settings, driving.reporter) as recorded:
            return recorded_kind(recorded.kind, recorded.text).resume(recorded, settings, driving)


def extract_lora(
    model: str, base_model: str, out: PathLike, *, max_rank: int = 128, sv_epsilon: float = 0.0,
    distribute_scale: bool = True, embed_lora: bool = False, save_modules: Sequence[str] = (),
    exclude_regexes: Sequence[str] = (), include_regexes: Sequence[str] = (), skip_undecomposable: bool = False,
    exact: bool = False, allow_crimes: bool = False, unsafe_truncate_embeddings: bool = False,
    random_seed: int = DEFAULT_SEED, write_model_card: bool = True, state_dir: PathLike | None = None,
    restart: bool = False, max_memory: int | str | None = None, device: str = "cpu",
    max_gpu_memory: int | str | None = None, staging: bool | PathLike | None = None,
    max_disk: int | str | None = None, public: bool = False, commit_every: int | None = None,
    commit_interval: float | None = None,
    cache_dir: PathLike | None = None, num_threads: int | None = None, plan: bool = False,
    progress: bool | Reporter = False, should_stop: Callable[[], bool] | None = None, fresh_process: bool = False,
) -> Outcome | Estimate:
    """Extract a PEFT LoRA adapter of ``model`` (the fine-tune) against ``base_model`` into ``out``, like
    ``resumerge extract-lora`` (mergekit-extract-lora's options and meanings; ``exact`` computes mergekit's full
    SVD instead of the seeded randomized truncation). Journaled like a merge: :func:`resume` finishes it. The
    other options mean what they mean for :func:`run`. Each module's factors are kept in the state dir until the
    adapter is committed, then deleted here.

    ``plan=True`` returns :func:`estimate_extraction`'s estimate instead (``fresh_process`` as there), writing
    nothing; call that function for it, which always returns an estimate.
    """
    spec = ExtractSpec(model=model, base_model=base_model, max_rank=max_rank, sv_epsilon=sv_epsilon,
                       distribute_scale=distribute_scale, embed_lora=embed_lora, save_modules=tuple(save_modules),
                       exclude_regexes=tuple(exclude_regexes), include_regexes=tuple(include_regexes),
                       skip_undecomposable=skip_undecomposable, exact=exact)
    settings = run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory,
                            max_gpu_memory=max_gpu_memory, staging=staging, max_disk=max_disk,
                            output=hub_output(public, commit_every, commit_interval), num_threads=num_threads)
    call = _extraction_call(spec, out, settings, random_seed=random_seed, device=device, allow_crimes=allow_crimes,
                            write_model_card=write_model_card, unsafe_truncate_embeddings=unsafe_truncate_embeddings)
    if plan:
        return _estimate_extraction(call, fresh_process)
    named(out)
    driving = Driving(stop_flag(should_stop), restart=restart)
    with nothing_started(out, state_dir):
        EXTRACTION.check(call, driving)
        return EXTRACTION.run(call, replace(driving, reporter=_reporter(progress)))


def estimate_extraction(
    model: str, base_model: str, out: PathLike, *, max_rank: int = 128, sv_epsilon: float = 0.0,
    distribute_scale: bool = True, embed_lora: bool = False, save_modules: Sequence[str] = (),
    exclude_regexes: Sequence[str] = (), include_regexes: Sequence[str] = (), skip_undecomposable: bool = False,
    exact: bool = False, allow_crimes: bool = False, unsafe_truncate_embeddings: bool = False,
    random_seed: int = DEFAULT_SEED, write_model_card: bool = True, state_dir: PathLike | None = None,
    max_memory: int | str | None = None, device: str = "cpu", staging: bool | PathLike | None = None,
    max_disk: int | str | None = None, cache_dir: PathLike | None = None, num_threads: int | None = None,
    fresh_process: bool = False,
) -> Estimate:
    """Validate the LoRA extraction that :func:`extract_lora` would run with these options (they mean what they
    mean there) and return its :class:`~resumerge.estimate.costs.Estimate`, as :func:`estimate` does for a merge
    (``fresh_process`` as there; ``resumerge extract-lora --plan``), writing nothing."""
    spec = ExtractSpec(model=model, base_model=base_model, max_rank=max_rank, sv_epsilon=sv_epsilon,
                       distribute_scale=distribute_scale, embed_lora=embed_lora, save_modules=tuple(save_modules),
                       exclude_regexes=tuple(exclude_regexes), include_regexes=tuple(include_regexes),
                       skip_undecomposable=skip_undecomposable, exact=exact)
    settings = run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory, staging=staging,
                            max_disk=max_disk, num_threads=num_threads)
    call = _extraction_call(spec, out, settings, random_seed=random_seed, device=device, allow_crimes=allow_crimes,
                            write_model_card=write_model_card, unsafe_truncate_embeddings=unsafe_truncate_embeddings)
    return _estimate_extraction(call, fresh_process)


def status(out: PathLike, *, state_dir: PathLike | None = None) -> StatusReport | RecipeStatus:
    """Where the merge into ``out`` stands, like ``resumerge status --json``: a :class:`StatusReport`, or for a
    recipe's OUT a :class:`~resumerge.recipes.view.RecipeStatus` (every stage, and the one in progress)."""
    from resumerge.config.locations import RunLocations
    from resumerge.store.statusview import read_status

    named(out)
    own = own_record(out, state_dir)
    if own is not None:
        return own.status_own(out, state_dir)
    report = read_status(out, state_dir)
    report = recorded_kind(report.kind, report.recorded_text).status(report, RunLocations.of(out, state_dir))
    return _with_check(report, out, state_dir)


def _with_check(report: StatusReport, out: PathLike, state_dir: PathLike | None) -> StatusReport:
    """``report`` with the newest ``resumerge check`` of ``out`` (running: its layer and model; done: its
    verdict) added to what its kind of run said: a row, and ``check`` in the JSON."""
    from resumerge.check.progress import CHECKS_DIR, describe, find_progress
    from resumerge.config.locations import state_root
    from resumerge.store.statusview import Details

    if str(out).startswith("hf://"):
        return report
    found = find_progress(state_root(state_dir) / CHECKS_DIR, out)
    if found is None:
        return report
    details = report.details or Details()
    return replace(report, details=Details(counts=details.counts, rows=(*details.rows, ("check", describe(found))),
                                           data={**details.data, "check": found}))


def recipe_status(out: PathLike, *, state_dir: PathLike | None = None) -> RecipeStatus:
    """Where the recipe writing to ``out`` stands (every stage, and the one in progress); raises LedgerError when
    ``out`` holds no recipe. :func:`status` answers this for a recipe's OUT too."""
    from resumerge.recipes.view import read_recipe_status

    return read_recipe_status(out, state_dir)


def verify(out: PathLike, *, state_dir: PathLike | None = None) -> VerifyReport:
    """Re-hash ``out``'s committed files, like ``resumerge verify``."""
    from resumerge.store.integrity import verify_output

    named(out)
    return verify_output(out, state_dir)


def check(model: PathLike, *, base: PathLike | None = None, parents: Sequence[PathLike] = (),
          prompts: PathLike | None = None, max_memory: int | str | None = None,
          state_dir: PathLike | None = None) -> CheckReport:
    """Does the merge in ``model`` work, like ``resumerge check``: a static pass over its tensors and a forward
    pass, one decoder layer of one model at a time, of it, its ``base`` and its ``parents`` (a resumerge
    output's come from its record when none is given) over built-in texts or ``prompts`` (a file, one text per
    line); the report's ``verdict`` is works, no_effect or broken, its ``exit_code`` 0, 5 or 6. Journaled per
    layer under ``state_dir``: a killed check resumes at the layer it reached, with the same report."""
    from resumerge.check.run import run_check

    return run_check(model, base=base, parents=tuple(parents), prompts=prompts,
                     max_memory=parse_size(max_memory) if isinstance(max_memory, str) else max_memory,
                     state_dir=state_dir)


def plan_merge(config: PathLike, *, out_shard_size: int | str = DEFAULT_SHARD_SIZE,
               random_seed: int = DEFAULT_SEED, allow_crimes: bool = False,
               unsafe_truncate_embeddings: bool = False, allow_same_experts: bool = False,
               dequantize: bool = False, out_type: str = "safetensors", gguf_type: str = "f16",
               codecs: CodecTable | None = None) -> Plan:
    """Validate ``config`` against the models' headers and return the frozen plan; writes nothing (a
    mergekit-moe config's hidden-state routers are not computed). ``codecs``: as for :func:`run`."""
    options = plan_options(out_shard_size=out_shard_size, random_seed=random_seed, allow_crimes=allow_crimes,
                           unsafe_truncate_embeddings=unsafe_truncate_embeddings, dequantize=dequantize,
                           out_type=out_type, gguf_type=gguf_type)
    text = config_text(config)
    call = Call(config, text, None, options, RunSettings(), allow_same_experts=allow_same_experts, codecs=codecs)
    return planner_of(kind_of(text)).plan(call)


def estimate(
    config: PathLike,
    out: PathLike | None = None,
    *,
    state_dir: PathLike | None = None,
    out_shard_size: int | str | None = None,
    random_seed: int = DEFAULT_SEED,
    copy_tokenizer: bool = True,
    allow_crimes: bool = False,
    allow_same_experts: bool = False,
    unsafe_truncate_embeddings: bool = False,
    dequantize: bool = False,
    out_type: str = "safetensors",
    gguf_type: str = "f16",
    max_memory: int | str | None = None,
    cache_dir: PathLike | None = None,
    stream_inputs: bool = False,
    device: str = "cpu",
    num_threads: int | None = None,
    staging: bool | PathLike | None = None,
    probe_size: int | str = "32MiB",
    intermediate_dir: PathLike | None = None,
    max_disk: int | str | None = None,
    bandwidth: str | None = None,
    session: str | None = None,
    disk_free: Callable[[Path], int] | None = None,
    fresh_process: bool = False,
    executor: Executor | None = None,
) -> Estimate | RecipeEstimate:
    """Validate ``config`` and estimate disk, downloads, peak RAM and time of merging it into ``out``, like
    ``resumerge plan CONFIG OUT``; ``.fits`` and ``.reasons`` give the verdict, ``.to_json()`` the document
    ``plan --json`` prints. Writes nothing but the disk probe's temp file (deleted; ``probe_size=0`` skips it).

    The options mean what they mean for :func:`run` (``executor`` is checked, not timed): compute is timed on
    ``device`` with ``num_threads`` threads (a GPU this machine lacks is refused, exit 2). ``out`` may be an
    ``hf://`` target and ``max_disk`` bounds the local disk. A multi-document ``config`` is a recipe: every stage
    is estimated (a :class:`~resumerge.recipes.estimate.RecipeEstimate`), which needs ``out`` to place them
    (``intermediate_dir`` as for :func:`run`). ``disk_free`` replaces the free-space reading (tests simulate small
    disks with it); ``fresh_process`` says this process was started for this estimate, as the merge's will be (the
    CLI), so its age counts as the merge's start-up. Raises the same errors as :func:`plan_merge` for an invalid
    merge; a merge that does not fit is not an error.

    A merge with hub inputs or an ``hf://`` OUT gets a network estimate (``.network``, none for a recipe): bytes
    each way at ``bandwidth`` (``"DOWN[/UP]"`` per second, e.g. ``"150MB/75MB"``) or at a download rate measured by
    two range reads (``probe_size=0`` skips them), and the pipelined run's wall time with what bounds it.
    ``session`` (a length, ``"12h"``) asks how many notebook sessions of that length the merge takes
    (``.session``).
    """
    from resumerge.estimate.estimate import Measuring
    from resumerge.estimate.network import parse_bandwidth
    from resumerge.estimate.sessions import parse_duration
    from resumerge.plan.sharding import shard_size_choice
    from resumerge.store.diskprobe import free_bytes

    if out is not None:
        named(out)
    link = parse_bandwidth(bandwidth) if bandwidth is not None else None
    length = parse_duration(session) if session is not None else None
    options = plan_options(out_shard_size=shard_size_choice(out_shard_size, out)[0], random_seed=random_seed,
                           copy_tokenizer=copy_tokenizer, device=device, allow_crimes=allow_crimes,
                           stream_inputs=stream_inputs, unsafe_truncate_embeddings=unsafe_truncate_embeddings,
                           dequantize=dequantize, out_type=out_type, gguf_type=gguf_type)
    settings = run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory, staging=staging,
                            max_disk=max_disk, num_threads=num_threads, executor=executor)
    usable_device(options.device)
    measuring = Measuring(probe_bytes=parse_size(probe_size, option="--probe-size"),
                          disk_free=disk_free or free_bytes, bandwidth=link)
    text = config_text(config)
    call = Call(config, text, out, options, settings, allow_same_experts=allow_same_experts)
    result = kind_of(text).estimate(call, measuring, fresh_process=fresh_process, intermediate_dir=intermediate_dir)
    from resumerge.recipes import estimate as recipes

    if isinstance(result, recipes.RecipeEstimate):  # a plan per stage, each with its own shard size
        return result
    return replace(result, shard_choice=shard_size_choice(out_shard_size, out)[1],  # plan says why, when it chose
                   session=result.sessions_of(length) if length is not None else None)


def _extraction_call(spec: ExtractSpec, out: PathLike, settings: RunSettings, *, random_seed: int, device: str,
                     allow_crimes: bool, write_model_card: bool, unsafe_truncate_embeddings: bool) -> Call:
    """The call of the extraction ``spec`` into ``out`` (its recorded text is the spec's; one adapter file)."""
    from resumerge.extract.spec import spec_text

    options = plan_options(out_shard_size=DEFAULT_SHARD_SIZE, random_seed=random_seed, copy_tokenizer=False,
                           device=device, allow_crimes=allow_crimes, write_model_card=write_model_card,
                           unsafe_truncate_embeddings=unsafe_truncate_embeddings, num_threads=settings.num_threads)
    text = spec_text(spec)
    return Call(text, text, out, options, settings)


def _estimate_extraction(call: Call, fresh_process: bool) -> Estimate:
    from resumerge.estimate.estimate import Measuring

    return EXTRACTION.estimate(call, Measuring(), fresh_process=fresh_process, intermediate_dir=None)


def _reporter(progress: bool | Reporter) -> Reporter | None:
    """The reporter of one call: the caller's own (the CLI hands in its display, and closes it), or None. The
    terminal's display is the CLI's to make: ``progress=True`` is deprecated and shows nothing."""
    if progress is True:
        warnings.warn("progress=True is deprecated and shows nothing: hand in a reporter, e.g. "
                      "progress=resumerge.cli.render.ProgressReporter() (close it after the call)",
                      DeprecationWarning, stacklevel=3)
    return None if isinstance(progress, bool) else progress

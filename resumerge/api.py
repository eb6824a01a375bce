"""The front door: ``run``, ``resume``, ``status``, ``verify``, ``estimate`` (what ``resumerge plan`` prints),
``plan_merge`` and ``extract_lora``, for the CLI and for notebooks alike.

This is the only place that decides what a run is — a single merge, a recipe (several YAML documents), an MoE
upcycling (a mergekit-moe config, planned by :mod:`resumerge.moe`) or a LoRA extraction (:func:`extract_lora`,
planned by :mod:`resumerge.extract`) — and it owns every guard and option: each CLI
command parses its arguments and makes one call here, so a notebook gets the very tool the README describes.
Every function takes flat keyword parameters and packs them, in :func:`_plan_options` and :func:`_run_settings`
alone, into the :class:`~resumerge.plan.merge_plan.PlanOptions` that change output bytes and the
:class:`~resumerge.config.settings.RunSettings` that do not. Errors are the :mod:`resumerge.errors` exceptions
that the CLI maps to exit codes.

A new kind of run plugs in here (which planner makes its :class:`~resumerge.plan.merge_plan.Plan`) and then goes
through the one session path, :func:`resumerge.engine.session.run_plan`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.settings import HubOutputOptions, RunSettings
from resumerge.errors import OutputDirError, UsageError
from resumerge.memory.sizes import parse_size
from resumerge.plan.merge_plan import DEFAULT_SEED, DEFAULT_SHARD_SIZE
from resumerge.plan.sharding import shard_size_choice

# Only what ``status`` and ``verify`` need is imported here, so that they stay fast (no torch): the merging
# commands import the engine inside the function.
if TYPE_CHECKING:
    from collections.abc import Sequence

    from resumerge.engine.costs import Estimate
    from resumerge.engine.drive import Outcome
    from resumerge.engine.executor import Reporter
    from resumerge.moe import MoeConfig
    from resumerge.moe.passproc import PassProcess
    from resumerge.plan.merge_plan import Plan, PlanOptions
    from resumerge.plan.prepared import Prepared
    from resumerge.recipes.estimate import RecipeEstimate
    from resumerge.recipes.view import RecipeStatus
    from resumerge.store.integrity import VerifyReport
    from resumerge.store.statusview import StatusReport

PathLike = str | os.PathLike[str]


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
    cache_dir: PathLike | None = None,
    num_threads: int | None = None,
    progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None,
) -> Outcome:
    """Merge ``config`` into ``out``, like ``resumerge run``. ``config`` is a YAML file (a ``Path``, or a ``str``
    naming one) or YAML text (a ``str`` holding a newline or a one-line YAML mapping); the same holds for every
    ``config`` parameter here.

    ``stream_inputs`` (``--stream-inputs``) reads every hub input's tensors by HTTP Range instead of downloading
    its files; by default a file is streamed when the merge needs less than half of it, or when downloading it
    would break ``max_disk``. ``cache_dir`` (``--transformers-cache``) is the Hugging Face cache for hub models;
    ``num_threads`` (``-j``) torch's thread count.

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

    ``progress=True`` draws the CLI's rich progress; a reporter object is used as given (the caller closes it).
    ``should_stop`` is polled at safe points: once true, the run stops and raises InterruptedMerge (exit 3).
    """
    _named(out)
    text = _config_text(config)
    from resumerge.moe.passproc import started_early
    from resumerge.recipes.recipe import is_recipe_text

    recipe = is_recipe_text(text)
    moe = None if recipe else _moe_config(text, _source(config, "config"), allow_same_experts=allow_same_experts)
    with started_early(moe.gate_mode if moe else None, state_dir) as early:  # loads while this process does
        options = _plan_options(out_shard_size=shard_size_choice(out_shard_size, out)[0], random_seed=random_seed,
                                copy_tokenizer=copy_tokenizer, device=device, allow_crimes=allow_crimes,
                                stream_inputs=stream_inputs, write_model_card=write_model_card, dequantize=dequantize,
                                unsafe_truncate_embeddings=unsafe_truncate_embeddings, num_threads=num_threads)
        settings = _run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory,
                                 max_gpu_memory=max_gpu_memory, staging=staging, max_disk=max_disk,
                                 output=_output(public, commit_every, commit_interval), num_threads=num_threads)
        if not recipe:
            _single_merge_only(config, out, settings, intermediate_dir=intermediate_dir,
                               cleanup_intermediates=cleanup_intermediates)
        with _Progress(progress) as reporter:
            if recipe:
                from resumerge.recipes.run import run_recipe

                return run_recipe(text, out, options, settings, intermediate_dir=intermediate_dir, restart=restart,
                                  cleanup=cleanup_intermediates, reporter=reporter, should_stop=_stop(should_stop),
                                  source=_source(config, "recipe")).outcome()
            if moe is not None:
                return _run_moe(moe, text, out, options, settings, early, restart=restart, reporter=reporter,
                                should_stop=_stop(should_stop))
            from resumerge.engine.session import run_merge

            return run_merge(text, out, options, settings, restart=restart, reporter=reporter,
                             should_stop=_stop(should_stop))


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
    progress: bool | Reporter = False,
    should_stop: Callable[[], bool] | None = None,
) -> Outcome:
    """Finish the merge recorded for ``out``, like ``resumerge resume`` (for a recipe: every stage still to do,
    returning the final stage's outcome); an ``hf://`` OUT resumes from the repo alone. The options mean what they
    mean for :func:`run`; none of them changes the output, so they may differ from the first run's — but
    ``num_threads``: a run whose methods' bytes depend on it (slerp, karcher, model_stock, nuslerp) reuses the
    recorded count, and a different one is refused (UsageError)."""
    from resumerge.recipes.view import is_recipe_out

    _named(out)
    settings = _run_settings(state_dir=state_dir, max_memory=max_memory, max_gpu_memory=max_gpu_memory,
                             staging=staging, max_disk=max_disk, output=_output(False, commit_every, commit_interval),
                             num_threads=num_threads)
    with _Progress(progress) as reporter:
        if is_recipe_out(out, state_dir):
            from resumerge.recipes.run import resume_recipe

            return resume_recipe(out, settings, cleanup=cleanup_intermediates, reporter=reporter,
                                 should_stop=_stop(should_stop)).outcome()
        from resumerge.engine.session import resume_merge

        outcome = resume_merge(out, settings, reporter=reporter, should_stop=_stop(should_stop),
                               other_kind=functools.partial(_recorded_kind, out=out))
    _finished_extraction(outcome, out, state_dir)
    return outcome


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
    other options mean what they mean for :func:`run`.

    ``plan=True`` (``--plan``) validates everything and returns the :class:`~resumerge.engine.costs.Estimate` of
    the extraction instead (as :func:`estimate` does for a merge; ``fresh_process`` as there), writing nothing.
    Each module's factors are kept in the state dir until the adapter is committed, then deleted here.
    """
    from resumerge.extract.spec import ExtractSpec, spec_text

    text = spec_text(ExtractSpec(
        model=model, base_model=base_model, max_rank=max_rank, sv_epsilon=sv_epsilon,
        distribute_scale=distribute_scale, embed_lora=embed_lora, save_modules=tuple(save_modules),
        exclude_regexes=tuple(exclude_regexes), include_regexes=tuple(include_regexes),
        skip_undecomposable=skip_undecomposable, exact=exact))
    options = _plan_options(out_shard_size=DEFAULT_SHARD_SIZE, random_seed=random_seed, copy_tokenizer=False,
                            device=device, allow_crimes=allow_crimes, write_model_card=write_model_card,
                            unsafe_truncate_embeddings=unsafe_truncate_embeddings, num_threads=num_threads)
    settings = _run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory,
                             max_gpu_memory=max_gpu_memory, staging=staging, max_disk=max_disk,
                             output=_output(public, commit_every, commit_interval), num_threads=num_threads)
    if plan:
        from resumerge.engine.estimate import estimate_config

        _usable_device(options.device)
        return estimate_config(text, options, settings, source="extraction", out_dir=out,
                               fresh_process=fresh_process,
                               planner=lambda: _plan_extraction(text, options, settings=settings))
    _named(out)
    _single_merge_only(text, out, settings, intermediate_dir=None, cleanup_intermediates=False)
    from resumerge.engine.session import run_plan
    from resumerge.engine.target import Target

    if restart:
        from resumerge.extract.prepare import clear_factors

        clear_factors(out, state_dir)
    with _Progress(progress) as reporter:
        target = Target.open(out, settings)
        prepared = _plan_extraction(text, options, settings=settings, out=out, reporter=reporter)
        outcome = run_plan(prepared, text, target, settings, restart=restart, reporter=reporter,
                           should_stop=_stop(should_stop))
    _finished_extraction(outcome, out, state_dir)
    return outcome


def status(out: PathLike, *, state_dir: PathLike | None = None) -> StatusReport | RecipeStatus:
    """Where the merge into ``out`` stands, like ``resumerge status --json``: a :class:`StatusReport`, or for a
    recipe's OUT a :class:`~resumerge.recipes.view.RecipeStatus` (every stage, and the one in progress)."""
    from resumerge.recipes.view import is_recipe_out
    from resumerge.store.statusview import read_status

    _named(out)
    if is_recipe_out(out, state_dir):
        return recipe_status(out, state_dir=state_dir)
    return read_status(out, state_dir)


def recipe_status(out: PathLike, *, state_dir: PathLike | None = None) -> RecipeStatus:
    """Where the recipe writing to ``out`` stands (every stage, and the one in progress); raises LedgerError when
    ``out`` holds no recipe. :func:`status` answers this for a recipe's OUT too."""
    from resumerge.recipes.view import read_recipe_status

    return read_recipe_status(out, state_dir)


def verify(out: PathLike, *, state_dir: PathLike | None = None) -> VerifyReport:
    """Re-hash ``out``'s committed files, like ``resumerge verify``."""
    from resumerge.store.integrity import verify_output

    _named(out)
    return verify_output(out, state_dir)


def plan_merge(config: PathLike, *, out_shard_size: int | str = DEFAULT_SHARD_SIZE,
               random_seed: int = DEFAULT_SEED, allow_crimes: bool = False,
               unsafe_truncate_embeddings: bool = False, allow_same_experts: bool = False,
               dequantize: bool = False) -> Plan:
    """Validate ``config`` against the models' headers and return the frozen plan; writes nothing (a
    mergekit-moe config's hidden-state routers are not computed)."""
    from resumerge.config.merge_config import load_config_text
    from resumerge.engine.session import plan_from_config

    options = _plan_options(out_shard_size=out_shard_size, random_seed=random_seed, allow_crimes=allow_crimes,
                            unsafe_truncate_embeddings=unsafe_truncate_embeddings, dequantize=dequantize)
    text, source = _config_text(config), _source(config, "config")
    moe = _moe_config(text, source, allow_same_experts=allow_same_experts)
    if moe is not None:
        from resumerge.moe.prepare import prepare_moe

        return prepare_moe(moe, options, RunSettings(), forward=False).plan
    return plan_from_config(load_config_text(text, source=source), options)


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
    disk_free: Callable[[Path], int] | None = None,
    fresh_process: bool = False,
) -> Estimate | RecipeEstimate:
    """Validate ``config`` and estimate disk, downloads, peak RAM and time of merging it into ``out``, like
    ``resumerge plan CONFIG OUT``; ``.fits`` and ``.reasons`` give the verdict, ``.to_json()`` the document
    ``plan --json`` prints. Writes nothing but the disk probe's temp file (deleted; ``probe_size=0`` skips it).

    The options mean what they mean for :func:`run`: compute is timed on ``device`` with ``num_threads`` threads
    (a GPU this machine lacks is refused, exit 2). ``out`` may be an ``hf://`` target and ``max_disk`` bounds the
    local disk. A multi-document ``config`` is a recipe: every stage is estimated (a
    :class:`~resumerge.recipes.estimate.RecipeEstimate`), which needs ``out`` to place them
    (``intermediate_dir`` as for :func:`run`). ``disk_free`` replaces the free-space reading (tests simulate small
    disks with it); ``fresh_process`` says this process was started for this estimate, as the merge's will be (the
    CLI), so its age counts as the merge's start-up. Raises the same errors as :func:`plan_merge` for an invalid
    merge; a merge that does not fit is not an error.

    A merge with hub inputs or an ``hf://`` OUT gets a network estimate (``.network``, none for a recipe): bytes
    each way at ``bandwidth`` (``"DOWN[/UP]"`` per second, e.g. ``"150MB/75MB"``) or at a download rate measured by
    two range reads (``probe_size=0`` skips them), and the pipelined run's wall time with what bounds it.
    """
    from resumerge.engine.netestimate import parse_bandwidth
    from resumerge.store.diskprobe import free_bytes

    if out is not None:
        _named(out)
    link = parse_bandwidth(bandwidth) if bandwidth is not None else None
    options = _plan_options(out_shard_size=shard_size_choice(out_shard_size, out)[0], random_seed=random_seed,
                            copy_tokenizer=copy_tokenizer, device=device, allow_crimes=allow_crimes,
                            stream_inputs=stream_inputs, unsafe_truncate_embeddings=unsafe_truncate_embeddings,
                            dequantize=dequantize)
    settings = _run_settings(state_dir=state_dir, cache_dir=cache_dir, max_memory=max_memory, staging=staging,
                             max_disk=max_disk, num_threads=num_threads)
    _usable_device(options.device)
    probe_bytes = parse_size(probe_size, option="--probe-size")
    text = _config_text(config)
    from resumerge.recipes.recipe import is_recipe_text

    if is_recipe_text(text):
        from resumerge.recipes.estimate import estimate_recipe

        _moe_config(text, _source(config, "the config"), allow_same_experts=allow_same_experts)  # a flag refused
        if out is None:
            raise UsageError("planning a recipe needs OUT: its stages are placed relative to it",
                             hint=f"resumerge plan {config} OUT")
        return estimate_recipe(text, options, settings, out_dir=out, source=_source(config, "recipe"),
                               intermediate_dir=intermediate_dir, probe_bytes=probe_bytes,
                               disk_free=disk_free or free_bytes)
    from resumerge.engine.estimate import Measuring, estimate_config

    source = _source(config, "config")
    moe = _moe_config(text, source, allow_same_experts=allow_same_experts)
    planner = prepass = None
    if moe is not None:  # planned without its prompt forward pass (the estimate counts it, not runs it)
        from resumerge.moe.passcost import estimators

        planner, prepass = estimators(moe, options, settings)
    measuring = Measuring(probe_bytes=probe_bytes, disk_free=disk_free or free_bytes, bandwidth=link)
    result = estimate_config(text, options, settings, source=source, out_dir=out, measuring=measuring,
                             fresh_process=fresh_process, planner=planner, prepass=prepass)
    return replace(result, shard_choice=shard_size_choice(out_shard_size, out)[1])  # plan says why, when it chose


# -- the one place flat parameters become PlanOptions and RunSettings --------------------------------------------


def _plan_options(*, out_shard_size: int | str | None, device: str = "cpu", **flags: Any) -> PlanOptions:
    """What changes the output's bytes (the plan's fingerprint; ``num_threads`` only for the methods whose bytes
    depend on it, the planner drops it for the others; shard size None: the planner's pick); ``flags`` are the
    other :class:`PlanOptions` fields, as given. UsageError if bad."""
    from resumerge.engine.devices import normalise_device
    from resumerge.plan.merge_plan import PlanOptions
    from resumerge.plan.sharding import AUTO_SHARD_SIZE  # the planner picks (an hf:// OUT's default)

    shard_size = _size(out_shard_size, "--out-shard-size")
    return PlanOptions(out_shard_size=AUTO_SHARD_SIZE if shard_size is None else shard_size,
                       device=normalise_device(device), **flags)


def _run_settings(*, state_dir: PathLike | None, cache_dir: PathLike | None = None,
                  max_memory: int | str | None = None, max_gpu_memory: int | str | None = None,
                  staging: bool | PathLike | None = None, max_disk: int | str | None = None,
                  output: HubOutputOptions | None = None, num_threads: int | None = None) -> RunSettings:
    """What never changes the output's bytes; raises UsageError (exit 2) for a bad value, before any work."""
    if num_threads is not None and num_threads < 1:
        raise UsageError("--num-threads must be at least 1")
    settings = RunSettings(state_dir=state_dir, cache_dir=cache_dir, max_memory=_size(max_memory, "--max-memory"),
                           max_gpu_memory=_size(max_gpu_memory, "--max-gpu-memory"), staging=staging,
                           max_disk=_size(max_disk, "--max-disk"), num_threads=num_threads)
    return settings if output is None else replace(settings, output=output)


def _output(public: bool, every: int | None, interval: float | None) -> HubOutputOptions:
    return HubOutputOptions.of(public=public, every=every, interval=interval)


def _size(value: int | str | None, option: str) -> int | None:
    """A size option in bytes (None: not given); raises UsageError for a size that is not positive."""
    if value is None:
        return None
    size = parse_size(value, option=option)
    if size <= 0:
        raise UsageError(f"{option} must be positive")
    return size


# -- guards and helpers ------------------------------------------------------------------------------------------


def _single_merge_only(config: PathLike, out: PathLike, settings: RunSettings, *,
                       intermediate_dir: PathLike | None, cleanup_intermediates: bool) -> None:
    """Refuse recipe-only options with a one-document config, and a single merge into a recipe's OUT (even with
    ``restart``: the recipe's record would be left stale)."""
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.recipes.manifest import RECIPE_MANIFEST_NAME
    from resumerge.recipes.view import is_recipe_out

    for flag, given in (("intermediate-dir", intermediate_dir is not None), ("cleanup-intermediates",
                                                                             cleanup_intermediates)):
        if given:
            raise UsageError(f"--{flag} applies to recipes only, and {_source(config, 'the config')} holds one "
                             "merge config", hint="separate a recipe's stages with --- lines")
    # A repo is asked (one small request): a single merge must not take over, or --restart away, a recipe's repo.
    if is_recipe_out(out, settings.state_dir) if is_hub_target(out) else \
            os.path.isfile(os.path.join(out, RECIPE_MANIFEST_NAME)):
        raise OutputDirError(f"{out} holds the output of a recipe ({RECIPE_MANIFEST_NAME})", path=str(out),
                             hint="use another OUT for a single merge")


def _named(out: PathLike) -> None:
    """Refuse an empty OUT (``run cfg.yml ""``): as a path it would be the current directory, never what was meant."""
    if not os.fspath(out).strip():
        raise UsageError("OUT is empty", hint="name an output directory, or a hub repo hf://NAMESPACE/NAME")


def _is_yaml_text(config: PathLike) -> bool:
    """The rule for every ``config`` parameter: a ``Path`` (any ``os.PathLike``) names a file; a ``str`` is YAML
    text when it holds a newline or is a YAML mapping on one line (``"{merge_method: linear, models: [...]}"``) and
    names no existing file; any other ``str`` names a file."""
    if not isinstance(config, str):
        return False
    if "\n" in config:
        return True
    if os.path.isfile(config):
        return False
    import yaml

    try:
        return isinstance(yaml.safe_load(config), dict)
    except yaml.YAMLError:
        return False


def _moe_config(text: str, source: str, *, allow_same_experts: bool) -> MoeConfig | None:
    """``text`` loaded as a mergekit-moe config (``base_model`` + ``experts``: MoE upcycling, planned by
    :mod:`resumerge.moe`), or None for a merge config (which the session loads); ``allow_same_experts`` is refused
    (exit 2) for the latter. Raises ConfigError naming the YAML path before any model is opened."""
    from resumerge.moe import is_moe_text, load_moe_text

    if is_moe_text(text):
        return load_moe_text(text, allow_all_same=allow_same_experts, source=source)
    if allow_same_experts:
        raise UsageError("--i-understand-this-is-not-useful-without-training applies to mergekit-moe configs "
                         f"(base_model and experts) only, and {source} is not one")
    return None


def _run_moe(config: MoeConfig, text: str, out: PathLike, options: PlanOptions, settings: RunSettings,
             early: PassProcess | None, *, restart: bool, reporter: Reporter | None,
             should_stop: Callable[[], bool]) -> Outcome:
    """MoE upcycling: its planner, then the one session path, the prompt forward pass (in ``early``, the process
    started for it) beside the merge where the budget holds both; nothing is read before the config and OUT."""
    from resumerge.engine.session import run_plan
    from resumerge.engine.target import Target

    target = Target.open(out, settings)
    prepared = _prepare_moe(config, options, settings, reporter, early=early)
    return run_plan(prepared, text, target, settings, restart=restart, reporter=reporter, should_stop=should_stop)


def _prepare_moe(config: MoeConfig, options: PlanOptions, settings: RunSettings, reporter: Reporter | None,
                 model_dirs: Mapping[str, str] | None = None, *, early: PassProcess | None = None
                 ) -> Prepared:
    """MoE upcycling's planner (:mod:`resumerge.moe`), which starts the hidden-state modes' prompt pass: beside the
    merge in ``early``, the process the caller started (and stops), where the budget allows; else it is done here."""
    from resumerge.engine.drive import hub_progress
    from resumerge.moe.prepare import prepare_moe

    return prepare_moe(config, options, settings, model_dirs=model_dirs, early=early,
                       on_progress=hub_progress(reporter), beside=early is not None)


def _recorded_kind(text: str, options: PlanOptions, model_dirs: Mapping[str, str], settings: RunSettings,
                   reporter: Reporter | None, *, out: PathLike) -> Prepared | None:
    """The plan of a recorded run into ``out`` of another kind than a merge config, for its resume: a LoRA
    extraction's spec or a mergekit-moe config (None for a merge config)."""
    from resumerge.extract.spec import is_extraction_text
    from resumerge.moe import is_moe_text, load_moe_text

    if is_extraction_text(text):
        return _plan_extraction(text, options, out=out, model_dirs=model_dirs, settings=settings,
                                reporter=reporter)
    if not is_moe_text(text):
        return None
    # Its experts may all be one model: that was allowed when the run started (the rule is about intent).
    return _prepare_moe(load_moe_text(text, allow_all_same=True), options, settings, reporter, model_dirs)


def _plan_extraction(text: str, options: PlanOptions, *, settings: RunSettings, out: PathLike | None = None,
                     model_dirs: Mapping[str, str] | None = None,
                     reporter: Reporter | None = None) -> Prepared:
    """The plan of the LoRA extraction recorded as ``text`` (:mod:`resumerge.extract`) and its opened inputs; its
    finished modules' factors are kept in ``out``'s run folder (None: an estimate, nothing kept)."""
    from resumerge.engine.drive import hub_progress
    from resumerge.extract.prepare import prepare_extraction

    return prepare_extraction(text, options, settings, out=out, model_dirs=model_dirs,
                              on_progress=hub_progress(reporter))


def _usable_device(device: str) -> None:
    """A GPU the run would refuse is refused by the estimate too (exit 2), rather than a plan that "fits"."""
    if device != "cpu":
        from resumerge.memory.cuda import CudaProbe

        CudaProbe(device)


def _finished_extraction(outcome: Outcome, out: PathLike, state_dir: PathLike | None) -> None:
    """After an extraction's adapter is committed nobody needs its modules' cached factors: delete them."""
    from resumerge.extract.spec import EXTRACTION_METHOD

    if outcome.plan.method == EXTRACTION_METHOD:  # a merge's resume never imports the extraction
        from resumerge.extract.prepare import forget_factors

        forget_factors(outcome.plan, out, state_dir)


def _config_text(config: PathLike) -> str:
    """The YAML text of ``config`` (see :func:`_is_yaml_text`); raises UsageError for a file that cannot be read."""
    if isinstance(config, str) and _is_yaml_text(config):
        return config
    from resumerge.config.merge_config import read_config_file

    return read_config_file(config)


def _source(config: PathLike, text_name: str) -> str:
    """The name errors about ``config`` start with: its file name, or ``text_name`` for YAML text."""
    return text_name if _is_yaml_text(config) else Path(config).name


def _stop(should_stop: Callable[[], bool] | None) -> Callable[[], bool]:
    return should_stop if should_stop is not None else (lambda: False)


class _Progress:
    """The reporter of one call: the caller's own, the CLI's rich display (``progress=True``, closed here even on
    errors), or None."""

    def __init__(self, progress: bool | Reporter) -> None:
        self.given = progress if not isinstance(progress, bool) else None
        self.owned = None
        if progress is True:
            from resumerge.cli.render import ProgressReporter

            self.owned = ProgressReporter()

    def __enter__(self) -> Reporter | None:
        return self.given if self.given is not None else self.owned

    def __exit__(self, *exc: object) -> None:
        if self.owned is not None:
            self.owned.close()

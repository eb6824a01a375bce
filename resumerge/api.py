"""The Python API, mirroring the CLI for notebook users: ``run``, ``resume``, ``status``, ``verify``, ``plan_merge``
and ``estimate`` (what ``resumerge plan`` prints).

Each function does what the command of the same name does and raises the same :mod:`resumerge.errors`
exceptions instead of printing and exiting. ``progress=True`` draws the same rich progress as the CLI.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.engine.session import Outcome, plan_from_config, read_config_file, resume_merge, run_merge
from resumerge.memory.sizes import parse_size
from resumerge.plan.merge_plan import DEFAULT_SEED, DEFAULT_SHARD_SIZE, Plan, PlanOptions
from resumerge.store.integrity import VerifyReport, verify_output
from resumerge.store.statusview import StatusReport, read_status

if TYPE_CHECKING:
    from collections.abc import Callable

    from resumerge.cli.render import ProgressReporter
    from resumerge.engine.costs import Estimate
    from resumerge.store.hubsink import HubOutputOptions
    from resumerge.store.recipeview import RecipeStatus

PathLike = str | os.PathLike[str]


def _config_text(config: PathLike) -> str:
    # A string with a newline is YAML text; anything else names a file.
    if isinstance(config, str) and "\n" in config:
        return config
    return read_config_file(config)


def run(
    config: PathLike,
    out: PathLike,
    *,
    state_dir: PathLike | None = None,
    out_shard_size: int | str = DEFAULT_SHARD_SIZE,
    random_seed: int = DEFAULT_SEED,
    restart: bool = False,
    copy_tokenizer: bool = True,
    allow_crimes: bool = False,
    progress: bool = False,
    max_memory: int | str | None = None,
    device: str = "cpu",
    max_gpu_memory: int | str | None = None,
    staging: bool | PathLike | None = None,
    intermediate_dir: PathLike | None = None,
    cleanup_intermediates: bool = False,
    max_disk: int | str | None = None,
    public: bool = False,
    commit_every: int = 20,
    commit_interval: float = 60.0,
    stream_inputs: bool = False,
    write_model_card: bool = True,
    unsafe_truncate_embeddings: bool = False,
) -> Outcome:
    """Merge ``config`` (a YAML file path or YAML text) into ``out``, like ``resumerge run``.

    ``stream_inputs`` (``--stream-inputs``) reads every hub input's tensors by HTTP Range instead of downloading
    its files; by default a file is streamed when the merge needs less than half of it, or when downloading it
    would break ``max_disk``.

    A multi-document ``config`` is a recipe (mergekit-multi): its named stages go to ``intermediate_dir``
    (default ``OUT.intermediates``, or under the state dir for an ``hf://`` OUT), deleted at the end with
    ``cleanup_intermediates``; the final stage's outcome is returned. With an ``hf://`` OUT only the final stage
    is committed to the repo, with the recipe's record.

    ``staging``: None stages files on local disk only when ``out`` is on Drive or another remote filesystem,
    True always, False never, or a local directory to stage in (``--staging-dir``).

    ``out`` may be ``"hf://NAMESPACE/NAME[@BRANCH]"``: the merge is committed to that hub repo (created private
    unless ``public``), in commits of ``commit_every`` files or every ``commit_interval`` seconds, keeping at most
    ``max_disk`` bytes of uncommitted output on the local disk.

    ``write_model_card=False`` (``--no-write-model-card``) writes no README.md and no mergekit_config.yml;
    ``unsafe_truncate_embeddings`` (``--unsafe-truncate-embeddings``) merges models whose vocabularies differ in
    size by keeping the common leading rows (config.json and the tokenizer are cut to match).
    """
    from resumerge.engine.devices import normalise_device

    options = PlanOptions(out_shard_size=parse_size(out_shard_size, option="out_shard_size"),
                          random_seed=random_seed, copy_tokenizer=copy_tokenizer, device=normalise_device(device),
                          allow_crimes=allow_crimes, stream_inputs=stream_inputs, write_model_card=write_model_card,
                          unsafe_truncate_embeddings=unsafe_truncate_embeddings)
    reporter = _reporter(progress)
    text = _config_text(config)
    try:
        from resumerge.config.recipe import is_recipe_text

        if is_recipe_text(text):
            from resumerge.engine.recipe_run import run_recipe

            return run_recipe(text, out, intermediate_dir=intermediate_dir, options=options, state_dir=state_dir,
                              restart=restart, cleanup=cleanup_intermediates, reporter=reporter,
                              max_memory=_budget(max_memory), max_gpu_memory=_budget(max_gpu_memory, "max_gpu_memory"),
                              staging=staging, max_disk=_budget(max_disk, "max_disk"),
                              output=_output(public, commit_every, commit_interval)).final
        return run_merge(text, out, options=options, state_dir=state_dir, restart=restart,
                         reporter=reporter, max_memory=_budget(max_memory),
                         max_gpu_memory=_budget(max_gpu_memory, "max_gpu_memory"), staging=staging,
                         max_disk=_budget(max_disk, "max_disk"), output=_output(public, commit_every, commit_interval))
    finally:
        if reporter is not None:
            reporter.close()


def resume(out: PathLike, *, state_dir: PathLike | None = None, progress: bool = False,
           max_memory: int | str | None = None, max_gpu_memory: int | str | None = None,
           staging: bool | PathLike | None = None, cleanup_intermediates: bool = False,
           max_disk: int | str | None = None, commit_every: int = 20, commit_interval: float = 60.0) -> Outcome:
    """Finish the merge recorded for ``out``, like ``resumerge resume`` (for a recipe: every stage still to do,
    returning the final stage's outcome); an ``hf://`` OUT resumes from the repo alone."""
    from resumerge.store.recipeview import is_recipe_out

    reporter = _reporter(progress)
    try:
        if is_recipe_out(out, state_dir):
            from resumerge.engine.recipe_run import resume_recipe

            return resume_recipe(out, state_dir=state_dir, cleanup=cleanup_intermediates, reporter=reporter,
                                 max_memory=_budget(max_memory),
                                 max_gpu_memory=_budget(max_gpu_memory, "max_gpu_memory"), staging=staging,
                                 max_disk=_budget(max_disk, "max_disk"),
                                 output=_output(False, commit_every, commit_interval)).final
        return resume_merge(out, state_dir=state_dir, reporter=reporter, max_memory=_budget(max_memory),
                            max_gpu_memory=_budget(max_gpu_memory, "max_gpu_memory"), staging=staging,
                            max_disk=_budget(max_disk, "max_disk"),
                            output=_output(False, commit_every, commit_interval))
    finally:
        if reporter is not None:
            reporter.close()


def status(out: PathLike, *, state_dir: PathLike | None = None) -> StatusReport:
    """Where the merge into ``out`` stands, like ``resumerge status --json``."""
    return read_status(out, state_dir)


def recipe_status(out: PathLike, *, state_dir: PathLike | None = None) -> RecipeStatus:
    """Where the recipe writing to ``out`` stands (every stage, and the one in progress), like ``resumerge status
    --json`` on a recipe's OUT."""
    from resumerge.store.recipeview import read_recipe_status

    return read_recipe_status(out, state_dir)


def verify(out: PathLike, *, state_dir: PathLike | None = None) -> VerifyReport:
    """Re-hash ``out``'s committed files, like ``resumerge verify``."""
    return verify_output(out, state_dir)


def plan_merge(config: PathLike, *, out_shard_size: int | str = DEFAULT_SHARD_SIZE,
               random_seed: int = DEFAULT_SEED, allow_crimes: bool = False,
               unsafe_truncate_embeddings: bool = False) -> Plan:
    """Validate ``config`` against the models' headers and return the frozen plan; writes nothing."""
    from resumerge.config.merge_config import load_config_text
    from resumerge.moe import is_moe_text, load_moe_text

    options = PlanOptions(out_shard_size=parse_size(out_shard_size, option="out_shard_size"),
                          random_seed=random_seed, allow_crimes=allow_crimes,
                          unsafe_truncate_embeddings=unsafe_truncate_embeddings)
    source = str(config) if not (isinstance(config, str) and "\n" in config) else "config"
    text = _config_text(config)
    if is_moe_text(text):  # a mergekit-moe config (base_model + experts)
        return plan_from_config(load_moe_text(text, allow_all_same=allow_crimes), options)
    return plan_from_config(load_config_text(text, source=Path(source).name), options)


def estimate(
    config: PathLike,
    out: PathLike | None = None,
    *,
    state_dir: PathLike | None = None,
    out_shard_size: int | str = DEFAULT_SHARD_SIZE,
    random_seed: int = DEFAULT_SEED,
    copy_tokenizer: bool = True,
    allow_crimes: bool = False,
    max_memory: int | str | None = None,
    cache_dir: PathLike | None = None,
    staging: bool | PathLike | None = None,
    probe_size: int | str = "32MiB",
    disk_free: Callable[[Path], int] | None = None,
    max_disk: int | str | None = None,
) -> Estimate:
    """Validate ``config`` and estimate disk, downloads, peak RAM and time of merging it into ``out``, like
    ``resumerge plan CONFIG OUT``; ``.fits`` and ``.reasons`` give the verdict, ``.to_json()`` the document
    ``plan --json`` prints. Writes nothing but the disk probe's temp file (deleted; ``probe_size=0`` skips it).

    ``out`` may be an ``hf://`` target and ``max_disk`` bounds the local disk, as for ``resumerge plan``.
    ``disk_free`` replaces the free-space reading (tests simulate small disks with it). Raises the same errors as
    :func:`plan_merge` for an invalid merge; a merge that does not fit is not an error.
    """
    from resumerge.engine.estimate import estimate_config
    from resumerge.store.diskprobe import free_bytes

    options = PlanOptions(out_shard_size=parse_size(out_shard_size, option="out_shard_size"),
                          random_seed=random_seed, copy_tokenizer=copy_tokenizer, allow_crimes=allow_crimes)
    source = str(config) if not (isinstance(config, str) and "\n" in config) else "config"
    return estimate_config(_config_text(config), options, source=Path(source).name, out_dir=out,
                           state_dir=state_dir, cache_dir=cache_dir, max_memory=_budget(max_memory),
                           staging=staging, probe_bytes=parse_size(probe_size, option="probe_size"),
                           disk_free=disk_free or free_bytes, max_disk=_budget(max_disk, "max_disk"))


def _output(public: bool, every: int, interval: float) -> HubOutputOptions:
    from resumerge.store.hubcommits import Batching
    from resumerge.store.hubsink import HubOutputOptions

    return HubOutputOptions(public=public, batching=Batching(every=every, interval=interval))


def _budget(value: int | str | None, option: str = "max_memory") -> int | None:
    return None if value is None else parse_size(value, option=option)


def _reporter(progress: bool) -> ProgressReporter | None:
    if not progress:
        return None
    from resumerge.cli.render import ProgressReporter

    return ProgressReporter()

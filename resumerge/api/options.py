"""The one place the API's flat keyword parameters become :class:`~resumerge.plan.merge_plan.PlanOptions` (what
changes the output's bytes) and :class:`~resumerge.config.settings.RunSettings` (what does not), and the guards
every kind of run shares: OUT named, a config given as a file or as YAML text, a recipe's OUT kept from a single
merge. Each raises :class:`~resumerge.errors.UsageError` (exit 2) for a bad value, before any work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.config.settings import KEEP_WORKERS, HubOutputOptions, RunSettings
from resumerge.errors import LedgerError, OutputDirError, UsageError
from resumerge.memory.sizes import parse_size

if TYPE_CHECKING:
    from resumerge.engine.executors import Executor
    from resumerge.plan.merge_plan import PlanOptions

PathLike = str | os.PathLike[str]


def plan_options(*, out_shard_size: int | str | None, device: str = "cpu", **flags: Any) -> PlanOptions:
    """What changes the output's bytes (the plan's fingerprint; ``num_threads`` only for the methods whose bytes
    depend on it, the planner drops it for the others; shard size None: the planner's pick; output shards named
    like the parent's, as every new run's); ``flags`` are the other :class:`PlanOptions` fields, as given.
    UsageError if bad."""
    from resumerge.engine.devices import normalise_device
    from resumerge.plan.merge_plan import PlanOptions
    from resumerge.plan.sharding import AUTO_SHARD_SIZE  # the planner picks (an hf:// OUT's default)

    shard_size = size_option(out_shard_size, "--out-shard-size")
    return PlanOptions(out_shard_size=AUTO_SHARD_SIZE if shard_size is None else shard_size,
                       device=normalise_device(device), parent_shard_names=True, **flags)


def run_settings(*, state_dir: PathLike | None, cache_dir: PathLike | None = None,
                 max_memory: int | str | None = None, max_gpu_memory: int | str | None = None,
                 staging: bool | PathLike | None = None, max_disk: int | str | None = None,
                 output: HubOutputOptions | None = None, num_threads: int | None = None,
                 executor: Executor | None = None) -> RunSettings:
    """What never changes the output's bytes; raises UsageError (exit 2) for a bad value, before any work (an
    executor that cannot run here, as Ray's without Ray installed, is one)."""
    from resumerge.engine.executors import executor_of

    if num_threads is not None and num_threads < 1:
        raise UsageError("--num-threads must be at least 1")
    settings = RunSettings(state_dir=state_dir, cache_dir=cache_dir, max_memory=size_option(max_memory, "--max-memory"),
                           max_gpu_memory=size_option(max_gpu_memory, "--max-gpu-memory"), staging=staging,
                           max_disk=size_option(max_disk, "--max-disk"), num_threads=num_threads, executor=executor)
    executor_of(settings).check()
    return settings if output is None else replace(settings, output=output)


def executor_option(executor: str, ray_address: str | None = None,
                    keep_workers: float | str | None = None) -> Executor | None:
    """The executor object of the command line's ``--executor NAME`` and its settings (``--ray-address``,
    ``--keep-workers``); None for ``local`` (the default). Raises UsageError for an unknown name and for a setting
    given to an executor that takes none."""
    from resumerge.engine.executors import RayExecutor

    if executor == "ray":
        return RayExecutor(address=ray_address, keep_workers=keep_option(keep_workers))
    if executor != "local":
        raise UsageError(f"--executor must be one of local, ray, not {executor!r}")
    if ray_address is not None or keep_workers is not None:
        raise UsageError(f"{'--ray-address' if ray_address is not None else '--keep-workers'} needs --executor ray")
    return None


def keep_option(keep: float | str | None) -> float:
    """The seconds of ``--keep-workers`` (a length with its unit, ``"10m"``; a number of seconds from the API; ``0``
    keeps none; None: the default, :data:`~resumerge.config.settings.KEEP_WORKERS`); raises UsageError (exit 2) for
    anything else, a bare number other than 0 in a string included (``--session`` reads one as hours: here it
    would be ambiguous)."""
    if keep is None:
        return KEEP_WORKERS
    if isinstance(keep, str):
        try:
            bare: float | None = float(keep)
        except ValueError:
            bare = None
        if bare == 0 or keep.strip() in ("0s", "0m", "0h"):
            return 0.0
        if bare is not None:
            raise UsageError(f"--keep-workers {keep.strip()}: give its unit", hint="e.g. --keep-workers 10m or 600s")
        from resumerge.estimate.sessions import parse_duration

        return parse_duration(keep, option="--keep-workers")
    if keep < 0:
        raise UsageError("--keep-workers must be at least 0")
    return float(keep)


@contextlib.contextmanager
def started_early(settings: RunSettings, out: PathLike, device: str | None = "cpu") -> Iterator[RunSettings]:
    """``settings`` with what their executor starts while the run plans (a Ray run's workers: see
    :meth:`~resumerge.engine.executors.Executor.starting`), ended as the call ends, however it ends; ``device``
    None where it is not known yet."""
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.engine.executors import executor_of

    bounded = settings.max_disk is not None and is_hub_target(out)
    with executor_of(settings).starting(settings, device=device, bounded=bounded) as started:
        yield replace(settings, executor=started)


def recorded_device(out: PathLike, settings: RunSettings) -> str | None:
    """The device the run recorded for ``out`` computes on, for a resume's :func:`started_early` (a Ray run's warm
    workers start without a GPU, which a GPU plan's run can never take): as its ledger in the state dir says, else
    as OUT's manifest in a folder says. None where only the hub can say (an ``hf://`` OUT whose state dir holds no
    ledger of it: the resume reads the repo's manifest itself, and starts no warm worker before). "cpu" for a local
    run and where nothing here can say (nothing recorded, or unreadable: the resume itself says what is wrong)."""
    from resumerge.engine.executors import executor_of

    if not executor_of(settings).starts_early:
        return "cpu"
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.config.locations import RunLocations
    from resumerge.store.ledger_read import reading, run_row
    from resumerge.store.manifest import read_manifest

    path, row = RunLocations.of(out, settings.state_dir).ledger, None
    if path.is_file():
        try:
            with reading(path, "ledger") as conn:
                row = run_row(conn)
        except LedgerError:
            row = None
    if row is not None:
        return str(row.options.get("device", "cpu"))
    if is_hub_target(out):
        return None
    try:
        manifest = read_manifest(Path(out))
    except (LedgerError, OSError):
        return "cpu"
    return "cpu" if manifest is None else str(manifest.options.get("device", "cpu"))


def hub_output(public: bool, every: int | None, interval: float | None) -> HubOutputOptions:
    """How an ``hf://`` OUT is created and committed (``--public``, ``--commit-every``, ``--commit-interval``)."""
    return HubOutputOptions.of(public=public, every=every, interval=interval)


def size_option(value: int | str | None, option: str) -> int | None:
    """A size option in bytes (None: not given); raises UsageError for a size that is not positive."""
    if value is None:
        return None
    size = parse_size(value, option=option)
    if size <= 0:
        raise UsageError(f"{option} must be positive")
    return size


def single_merge_only(config: PathLike, out: PathLike, settings: RunSettings, *,
                      intermediate_dir: PathLike | None, cleanup_intermediates: bool) -> None:
    """Refuse recipe-only options with a one-document config, and a single merge into a recipe's OUT (even with
    ``restart``: the recipe's record would be left stale)."""
    from resumerge.config.hubtarget import is_hub_target
    from resumerge.recipes.manifest import RECIPE_MANIFEST_NAME
    from resumerge.recipes.view import is_recipe_out

    for flag, given in (("intermediate-dir", intermediate_dir is not None), ("cleanup-intermediates",
                                                                             cleanup_intermediates)):
        if given:
            raise UsageError(f"--{flag} applies to recipes only, and {source_name(config, 'the config')} holds one "
                             "merge config", hint="separate a recipe's stages with --- lines")
    # A repo is asked (one small request): a single merge must not take over, or --restart away, a recipe's repo.
    if is_recipe_out(out, settings.state_dir) if is_hub_target(out) else \
            os.path.isfile(os.path.join(out, RECIPE_MANIFEST_NAME)):
        raise OutputDirError(f"{out} holds the output of a recipe ({RECIPE_MANIFEST_NAME})", path=str(out),
                             hint="use another OUT for a single merge")


def named(out: PathLike) -> None:
    """Refuse an empty OUT (``run cfg.yml ""``): as a path it would be the current directory, never what was meant."""
    if not os.fspath(out).strip():
        raise UsageError("OUT is empty", hint="name an output directory, or a hub repo hf://NAMESPACE/NAME")


def is_yaml_text(config: PathLike) -> bool:
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


def usable_device(device: str) -> None:
    """A GPU the run would refuse is refused by the estimate too (exit 2), rather than a plan that "fits"."""
    if device != "cpu":
        from resumerge.memory.cuda import CudaProbe

        CudaProbe(device)


def config_text(config: PathLike) -> str:
    """The YAML text of ``config`` (see :func:`is_yaml_text`); raises UsageError for a file that cannot be read."""
    if isinstance(config, str) and is_yaml_text(config):
        return config
    from resumerge.config.merge_config import read_config_file

    return read_config_file(config)


def source_name(config: PathLike, text_name: str) -> str:
    """The name errors about ``config`` start with: its file name, or ``text_name`` for YAML text."""
    return text_name if is_yaml_text(config) else Path(config).name


def stop_flag(should_stop: Callable[[], bool] | None) -> Callable[[], bool]:
    """``should_stop``, or a flag that never turns true."""
    return should_stop if should_stop is not None else (lambda: False)


@contextlib.contextmanager
def nothing_started(out: PathLike, state_dir: PathLike | None) -> Iterator[None]:
    """A new run into ``out``: an :class:`~resumerge.errors.UnreachableError` met inside the block while this
    state dir records no run into ``out`` (no ledger of a merge, nor of a recipe) is raised as
    :class:`~resumerge.errors.UnreachableInputError` ("nothing was started: … run the same command again", exit
    2), whether the hub was unreachable for an input or for OUT itself: exit 3's "resume" would find nothing to
    finish. Once a run is recorded it stays exit 3 (resume finishes it)."""
    from resumerge.config.locations import RunLocations
    from resumerge.errors import UnreachableError, UnreachableInputError
    from resumerge.recipes.ledger_read import RECIPE_LEDGER_NAME
    from resumerge.recipes.manifest import recipe_dir

    try:
        yield
    except UnreachableError as exc:
        where = RunLocations.of(out, state_dir)
        if where.ledger.exists() or (recipe_dir(where) / RECIPE_LEDGER_NAME).exists():
            raise UnreachableError.after_start(exc, where.resume_command) from None
        raise UnreachableInputError.before_start(exc) from None

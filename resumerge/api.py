"""The Python API, mirroring the CLI for notebook users: ``run``, ``resume``, ``status``, ``verify``, ``plan_merge``.

Each function does what the command of the same name does and raises the same :mod:`resumerge.errors`
exceptions instead of printing and exiting. ``progress=True`` draws the same rich progress as the CLI.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from resumerge.integrity import VerifyReport, verify_output
from resumerge.memory.sizes import parse_size
from resumerge.plan import DEFAULT_SEED, DEFAULT_SHARD_SIZE, Plan, PlanOptions
from resumerge.session import Outcome, plan_from_config, read_config_file, resume_merge, run_merge
from resumerge.statusview import StatusReport, read_status

if TYPE_CHECKING:
    from resumerge.render import ProgressReporter

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
    progress: bool = False,
    max_memory: int | str | None = None,
    device: str = "cpu",
    max_gpu_memory: int | str | None = None,
) -> Outcome:
    """Merge ``config`` (a YAML file path or YAML text) into ``out``, like ``resumerge run``."""
    from resumerge.devices import normalise_device

    options = PlanOptions(out_shard_size=parse_size(out_shard_size, option="out_shard_size"),
                          random_seed=random_seed, copy_tokenizer=copy_tokenizer, device=normalise_device(device))
    reporter = _reporter(progress)
    try:
        return run_merge(_config_text(config), out, options=options, state_dir=state_dir, restart=restart,
                         reporter=reporter, max_memory=_budget(max_memory),
                         max_gpu_memory=_budget(max_gpu_memory, "max_gpu_memory"))
    finally:
        if reporter is not None:
            reporter.close()


def resume(out: PathLike, *, state_dir: PathLike | None = None, progress: bool = False,
           max_memory: int | str | None = None, max_gpu_memory: int | str | None = None) -> Outcome:
    """Finish the merge recorded for ``out``, like ``resumerge resume``."""
    reporter = _reporter(progress)
    try:
        return resume_merge(out, state_dir=state_dir, reporter=reporter, max_memory=_budget(max_memory),
                            max_gpu_memory=_budget(max_gpu_memory, "max_gpu_memory"))
    finally:
        if reporter is not None:
            reporter.close()


def status(out: PathLike, *, state_dir: PathLike | None = None) -> StatusReport:
    """Where the merge into ``out`` stands, like ``resumerge status --json``."""
    return read_status(out, state_dir)


def verify(out: PathLike, *, state_dir: PathLike | None = None) -> VerifyReport:
    """Re-hash ``out``'s committed files, like ``resumerge verify``."""
    return verify_output(out, state_dir)


def plan_merge(config: PathLike, *, out_shard_size: int | str = DEFAULT_SHARD_SIZE,
               random_seed: int = DEFAULT_SEED) -> Plan:
    """Validate ``config`` against the models' headers and return the frozen plan; writes nothing."""
    from resumerge.config import load_config_text

    options = PlanOptions(out_shard_size=parse_size(out_shard_size, option="out_shard_size"),
                          random_seed=random_seed)
    source = str(config) if not (isinstance(config, str) and "\n" in config) else "config"
    return plan_from_config(load_config_text(_config_text(config), source=Path(source).name), options)


def _budget(value: int | str | None, option: str = "max_memory") -> int | None:
    return None if value is None else parse_size(value, option=option)


def _reporter(progress: bool) -> ProgressReporter | None:
    if not progress:
        return None
    from resumerge.render import ProgressReporter

    return ProgressReporter()

""":func:`resumerge.api.evaluate`'s work once its :class:`~resumerge.api.options.Settings` are checked and made its
:class:`~resumerge.config.settings.RunSettings`: the evaluation's settings built and checked (exit 2 before
anything is read), then the model evaluated where it is, or a merge config opened as the merge it describes, never
written."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from resumerge.api.options import Harness, Merging, PathLike, Settings, pass_placement
from resumerge.api.unwritten import open_unwritten
from resumerge.config.settings import RunSettings
from resumerge.errors import UsageError

if TYPE_CHECKING:
    from resumerge.analyses.evaluation import EvalReport
    from resumerge.analyses.evaluation.run import EvalStep
    from resumerge.analyses.evaluation.tasks import TaskIndex


def evaluate_with(target: PathLike, tasks: Sequence[str] | str, asked: Settings, settings: RunSettings,
                  harness: Harness, *, progress: Callable[[EvalStep], None] | None,
                  task_index: TaskIndex | None = None) -> EvalReport:
    """lm-eval's ``tasks`` on ``target`` (see :func:`resumerge.api.evaluate`) as ``asked`` (the device, how a merge
    config ``target`` is merged: refused, exit 2, for a model ``target``), its ``settings`` (the memory budgets
    parsed, the state dir resolved, the executor) and ``harness`` (lm-eval's options); ``task_index``: lm-eval's
    task index shared with other evaluations (None: one of its own)."""
    from resumerge.analyses.evaluation.run import is_config, run_eval
    from resumerge.analyses.evaluation.settings import EvalSettings, Seeds

    names = tuple(t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks))
    include, output = harness.include_path, harness.output_path
    evaluation = EvalSettings(
        tasks=names, include_path=os.fspath(include) if include is not None else None, limit=harness.limit,
        num_fewshot=harness.num_fewshot, apply_chat_template=harness.apply_chat_template,
        log_samples=harness.log_samples, output_path=os.fspath(output) if output is not None else None,
        max_memory=settings.max_memory, device=asked.resources.device, max_gpu_memory=settings.max_gpu_memory,
        seeds=Seeds.parse(harness.seed)).checked()
    placement = pass_placement(settings)
    merging = asked.merging
    if not is_config(os.fspath(target)):
        if merging != Merging():  # they change a merge, and a model TARGET is no merge to make
            changed = ", ".join(f"--{k.replace('_', '-')}" for k, v in vars(merging).items()
                                if v != getattr(Merging(), k))
            raise UsageError(f"{changed} applies to a merge config TARGET, and {os.fspath(target)} is a model",
                             hint=f"leave out {changed}")
        return run_eval(os.fspath(target), evaluation, state=settings.state, watcher=progress, placement=placement,
                        task_index=task_index)
    # A merge config: the merge it describes, each tensor merged by run's code as the pass reads it, never written
    # (planned, and refused in one line, before any weight is read); each tensor's merge admitted by a governor of
    # the budget as run admits its units.
    from resumerge.machine.memory import MemoryGovernor, SystemProbe, default_budget

    budget = evaluation.max_memory if evaluation.max_memory is not None else default_budget(SystemProbe())
    with MemoryGovernor(budget, SystemProbe()) as governor, \
            open_unwritten(target, Settings(merging=merging, state_dir=settings.state.given),
                           governor=governor) as merge:
        return run_eval(os.fspath(target), evaluation, state=settings.state, watcher=progress, unwritten=merge,
                        placement=placement, task_index=task_index, merge_words=_merge_words(merging))


def _merge_words(merging: Merging) -> tuple[str, ...]:
    """The flags of ``merging``'s settings other than their defaults, as the command that continues says them."""
    words: list[str] = []
    if merging.random_seed != Merging().random_seed:
        words += ["--random-seed", str(merging.random_seed)]
    words += ["--allow-crimes"] if merging.allow_crimes else []
    words += ["--unsafe-truncate-embeddings"] if merging.unsafe_truncate_embeddings else []
    return tuple(words)

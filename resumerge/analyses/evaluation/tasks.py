"""The tasks an evaluation runs, found and loaded by lm-eval's ``TaskManager`` before any weight is read: an unknown
name, or a task whose dataset cannot be loaded (offline, a missing data file), is one line and exit 2; so is a
generation task where the model cannot be held whole (:func:`generation_tasks` finds them)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.errors import UsageError

GENERATION = "generate_until"


@contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's and datasets' warnings while the tasks load (their defaults filled in) kept off the terminal."""
    names = ("lm-eval", "lm_eval", "datasets")
    levels = {n: logging.getLogger(n).level for n in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def task_manager(settings: EvalSettings) -> Any:
    """lm-eval's ``TaskManager`` with ``settings.include_path``'s YAMLs beside its own tasks; only those where they
    hold every task named (indexing lm-eval's own 14,000 task YAMLs takes most of a small evaluation's time).
    Raises :class:`UsageError` for a name neither lm-eval's own tasks (their names kept in the installation's cache:
    :mod:`.keptnames`) nor the include path's hold, before that index is built; without a kept set it is built, and
    its names kept, as :func:`loaded_tasks` then refuses the name."""
    from resumerge.analyses.evaluation.keptnames import KeptTaskNames

    if settings.include_path is None:
        kept = KeptTaskNames.here()
        own_names = kept.names() if kept is not None else None
        if own_names is not None:
            refuse_unknown(settings, own_names)  # before lm-eval (seconds to import) and its index (more to build)
    from lm_eval.tasks import TaskManager

    with _quiet():
        if settings.include_path is not None:
            own = TaskManager(include_path=settings.include_path, include_defaults=False)
            if all(name in set(own.all_tasks) for name in settings.lm_tasks):
                return own  # lm-eval's own tasks neither indexed nor listed
            kept = KeptTaskNames.here()
            own_names = kept.names() if kept is not None else None
            if own_names is not None:  # the full index holds lm-eval's own names and the include path's
                refuse_unknown(settings, own_names | set(own.all_tasks))
            return TaskManager(include_path=settings.include_path)
        built = TaskManager()
        if kept is not None and own_names is None:
            kept.keep(built.all_tasks)
        return built


def refuse_unknown(settings: EvalSettings, known: Collection[str]) -> None:
    """Raise :class:`UsageError` naming the tasks of ``settings`` that are not in ``known`` (lm-eval's names:
    tasks, groups, tags) nor a YAML path (lm-eval loads a path as it is)."""
    unknown = [n for n in settings.lm_tasks if n not in known and not n.endswith((".yaml", ".yml"))]
    if unknown:
        where = f", nor a task YAML in {settings.include_path}" if settings.include_path else ""
        raise UsageError(f"unknown task(s) {', '.join(unknown)}: not an lm-eval task, group or tag{where}",
                         hint="list them with lm-eval --tasks list, or name a folder of task YAMLs with "
                              "--include-path")


class TaskIndex:
    """The lm-eval ``TaskManager`` of :func:`task_manager`, built at its first use for a set of tasks and handed to
    every evaluation given this index: a search builds one for its planning and all its candidates (indexing
    lm-eval's own task YAMLs costs ~8 CPU s a time). Only the manager is shared; each evaluation loads its own task
    objects (they hold a run's requests). Pickled (a search's scorer sent to a Ray node), it travels empty: each
    process builds its own."""

    def __init__(self) -> None:
        self._built: dict[tuple[str | None, tuple[str, ...]], Any] = {}

    def manager(self, settings: EvalSettings) -> Any:
        """:func:`task_manager` of ``settings``, built once per include path and tasks."""
        key = (settings.include_path, settings.lm_tasks)
        if key not in self._built:
            self._built[key] = task_manager(settings)
        return self._built[key]

    def __getstate__(self) -> dict[str, Any]:
        return {"_built": {}}


@dataclass(frozen=True)
class LoadedTasks:
    """The tasks an evaluation names, loaded by lm-eval once (each a dataset read, its documents built): ``built``,
    the task dict lm-eval's ``TaskManager.load`` returns for every name at once (``tasks``, ``groups``,
    ``group_map``), whose task objects its ``evaluate`` then runs. Loaded again (the check, then the harness) they
    cost a second read of every dataset per evaluation, for the same objects."""

    built: Mapping[str, Any]

    @property
    def kinds(self) -> dict[str, str]:
        """Each task's output type, by name (a group's and a tag's tasks each under its own name)."""
        return {str(name): str(task.OUTPUT_TYPE) for name, task in self.built["tasks"].items()}

    def task(self, name: str) -> Any:
        """The task object loaded under ``name``."""
        return self.built["tasks"][name]

    def runs(self, settings: EvalSettings) -> dict[str, Any]:
        """The task dict lm-eval's ``evaluate`` runs: ``built`` less ``settings.yaml_texts`` (the text tasks written
        as task YAMLs, each named on its own, scored on resumerge's own pass: :mod:`.yamltasks`), as loading
        ``settings.lm_tasks`` alone gives it."""
        own = {t.name for t in settings.yaml_texts}
        return {**self.built, "tasks": {name: task for name, task in self.built["tasks"].items() if name not in own}}


def loaded_tasks(settings: EvalSettings, manager: Any, *, quiet: bool = False) -> LoadedTasks:
    """The lm-eval tasks the names in ``settings`` select (a group's, a tag's), loaded once as lm-eval's
    ``simple_evaluate`` loads them (their datasets included, its warnings said: the defaults it fills in), what the
    evaluation then runs; ``quiet``: its warnings kept off the terminal (a check whose tasks are loaded again to
    run: a search's planning). Raises :class:`UsageError` for a name lm-eval does not know and for a task whose
    dataset cannot be loaded, naming it and why (each name then loaded on its own to find it: only on the way to
    the refusal)."""
    refuse_unknown(settings, set(manager.all_tasks))
    try:
        with _quiet() if quiet else nullcontext():
            return LoadedTasks(manager.load(list(settings.lm_tasks)))
    except UsageError:  # a text task's YAML refused by its own class (.yamltasks): its own line
        raise
    except Exception as exc:  # lm-eval and datasets raise what they meet: one line names the task and why
        for name in settings.lm_tasks:
            try:
                with _quiet():
                    manager.load([name])
            except UsageError:
                raise
            except Exception as alone:
                raise UsageError(f"task {name} cannot be loaded: {_reason(alone)}",
                                 hint="its dataset must be in the datasets cache or in local files when offline "
                                      "(HF_DATASETS_OFFLINE=1)") from None
        # each loads alone: the names together are refused (lm-eval's: a task in two of the groups named)
        raise UsageError(f"tasks {', '.join(settings.lm_tasks)} cannot be loaded together: {_reason(exc)}",
                         hint="name each task once (a group's tasks are named by the group)") from None


def _reason(exc: Exception) -> str:
    """The first line of ``exc``'s message (its type where it has none)."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def generation_tasks(tasks: Mapping[str, str]) -> list[str]:
    """The tasks of ``tasks`` (name → output type) that generate text."""
    return sorted(name for name, kind in tasks.items() if kind == GENERATION)

"""lm-eval task entries of an evolve config (mergekit-evolve's ``tasks: [{name, weight, metric}]``), scored
through ``resumerge eval``: each candidate's merge config evaluated as the merge it describes, never written (each
tensor merged by ``run``'s method code as its layer runs), its evaluation journaled per layer so a killed one resumes.
Checked before any weight is read: every task known and loadable (offline: its data in local files), none that
generates text (a search scores log-likelihoods: mergekit-evolve's ``acc``-like metrics), the settings eval takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.errors import UsageError
from resumerge.runs.evolve import storage
from resumerge.runs.evolve.objective import one_by_one
from resumerge.runs.evolve.spec import EvolveSpec, Task

if TYPE_CHECKING:
    from resumerge.analyses.evaluation.tasks import TaskIndex

# Evaluates a merge config file's merge on the settings' tasks, its journal under a state dir: lm-eval's results.
Evaluate = Callable[[Path, EvalSettings, Path], Mapping[str, Any]]


def eval_settings(spec: EvolveSpec, include_path: str | None, device: str = "cpu") -> EvalSettings:
    """The evaluation the config's lm-eval tasks ask for (``limit``, ``num_fewshot``, ``apply_chat_template``)."""
    names = tuple(dict.fromkeys(t.name for t in spec.tasks if t.kind == "lm-eval"))
    return EvalSettings(tasks=names, include_path=include_path, limit=spec.limit, num_fewshot=spec.num_fewshot,
                        apply_chat_template=spec.apply_chat_template, device=device).checked()


def refuse_unscorable(settings: EvalSettings, index: TaskIndex | None = None) -> None:
    """Raise :class:`UsageError` for a task lm-eval does not know or cannot load, and for one that generates;
    ``index``: lm-eval's task index, kept for the candidates' evaluations (None: one for this check)."""
    from resumerge.analyses.evaluation.tasks import TaskIndex, generation_tasks, loaded_tasks

    generating = generation_tasks(loaded_tasks(settings, (index or TaskIndex()).manager(settings), quiet=True).kinds)
    if generating:
        raise UsageError(f"task {generating[0]} generates text, and a search scores each candidate by "
                         "log-likelihood", hint="give multiple-choice or perplexity tasks (acc, acc_norm, ...)")


class LmEvalCandidates:
    """Scores each candidate on the lm-eval tasks of ``tasks`` (see the module's docstring); ``say``: told where it
    is (None: ``progress.json`` in ``store`` alone)."""

    def __init__(self, store: Path, tasks: Sequence[Task], settings: EvalSettings, evaluate: Evaluate,
                 say: storage.Say | None = None) -> None:
        self.store, self.settings, self.evaluate = store, settings, evaluate
        self.say: storage.Say = say or partial(storage.say, store)
        self.tasks = tuple(t for t in tasks if t.kind == "lm-eval")

    def score(self, generation: int, configs: Sequence[Mapping[str, Any]],
              done: Callable[[int], dict[str, float] | None],
              record: Callable[[int, dict[str, float]], None]) -> list[dict[str, float]]:
        return one_by_one(configs, done, record, lambda index, config: self._scored(generation, index, config))

    def _scored(self, generation: int, index: int, config: Mapping[str, Any]) -> dict[str, float]:
        import yaml

        work = storage.work_dir(self.store, generation, index)
        work.mkdir(parents=True, exist_ok=True)
        target = work / "candidate.yml"
        target.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
        self.say(generation=generation, candidates=[index], phase="lm-eval", layer=None, layers=None)
        results = self.evaluate(target, self.settings, work / "eval-state")
        return {task.name: metric_of(results, task) for task in self.tasks}

def metric_of(results: Mapping[str, Any], task: Task) -> float:
    """``task``'s metric in lm-eval's results; :class:`UsageError` naming the ones there where it is not."""
    found = results.get("results", {}).get(task.name, {})
    if task.metric not in found:
        there = ", ".join(sorted(k for k in found if "," in k and not k.split(",")[0].endswith("_stderr")))
        raise UsageError(f"task {task.name} has no metric {task.metric}",
                         hint=f"its metrics are {there}" if there else "name one of the task's metrics")
    return float(found[task.metric])

"""lm-eval tasks of a structure search (multiple choice and perplexity: log-likelihoods), scored from the base's
cached hidden states as ``eval`` scores them on the candidate written by ``run``.

lm-eval's requests depend on the tasks, the tokenizer and the settings, never on the model's answers: so the
tasks are run once before the cache is built with a scorer that only keeps what it is asked (:func:`lm_group`:
the :class:`~resumerge.analyses.evaluation.requests.Scoring` of each call, their token runs joining the cache's
texts), and then, for each candidate, run again by lm-eval with the answers (log-likelihood, greedy) of the
candidate's layer path over those runs (:meth:`LmGroup.figures`): lm-eval's own metric code, its own requests,
``eval``'s tokenizer and the head's answers as ``eval``'s pass computes them (:func:`tail_answers`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from resumerge.analyses.evaluation.requests import Scoring
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.analyses.evaluation.tails import tail_answers
from resumerge.analyses.evaluation.tasks import TaskIndex
from resumerge.errors import UsageError
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.opening.opened import PassModel
from resumerge.machine.torch_import import torch
from resumerge.runs.evolve.lmeval import metric_of
from resumerge.runs.evolve.spec import Task

Answer = tuple[float, bool]
Key = tuple[str, str]  # a scoring's request kind and digest


@dataclass
class LmGroup:
    """The lm-eval ``tasks`` one evaluation scores together (the searched ones, or the held-out ones), its
    ``settings``, the base's tokenizer and context as ``eval`` loads them, the ``index`` of lm-eval's tasks, and
    what lm-eval asks of a model on them: each call's :class:`Scoring` by its key, their runs one list (``runs``),
    each scoring's first run in it (``first``)."""

    tasks: tuple[Task, ...]
    settings: EvalSettings
    tokenizer: Any
    max_length: int
    index: TaskIndex
    scorings: dict[Key, Scoring]
    runs: list[list[int]]
    first: dict[Key, int]

    def figures(self, stream: ModelStream, hidden: Sequence[torch.Tensor], groups: Sequence[Sequence[int]]
                ) -> dict[str, float]:
        """Each task's metric, lm-eval's, for the candidate whose last hidden states over this group's runs are
        ``hidden`` (a tensor a batch; batch ``b`` holds the runs ``groups[b]``)."""
        found = self._answers(stream, hidden, groups)

        def scorer(work: Scoring, kind: str) -> list[Answer]:
            key = (kind, work.digest())
            if key not in found:
                raise UsageError(f"lm-eval asked {kind} requests the search did not cache",
                                 hint="lm-eval's requests changed between two runs of the same tasks")
            return found[key]
        results = _evaluated(self, scorer)
        return {task.name: metric_of(results, task) for task in self.tasks}

    def _answers(self, stream: ModelStream, hidden: Sequence[torch.Tensor], groups: Sequence[Sequence[int]]
                 ) -> dict[Key, list[Answer]]:
        """Every request's answer, by its scoring: the head over each batch's last states, as ``eval``'s pass."""
        readers: dict[int, list[tuple[Key, int]]] = {}  # each run of the list: the requests reading it
        for key, work in self.scorings.items():
            for request, run in enumerate(work.run_of):
                readers.setdefault(self.first[key] + run, []).append((key, request))
        found = {key: [(0.0, False)] * len(work.run_of) for key, work in self.scorings.items()}
        for states, runs in zip(hidden, groups):
            wanted = [[self.scorings[k].targets[r] for k, r in readers.get(run, [])] for run in runs]
            for run, row in zip(runs, tail_answers(stream, states, [len(self.runs[i]) for i in runs], wanted)):
                for (key, request), answer in zip(readers.get(run, []), row):
                    found[key][request] = answer
        return found


def lm_settings(names: Sequence[str], include_path: str | None, limit: int | None, num_fewshot: int | None,
                apply_chat_template: bool, device: str) -> EvalSettings:
    """The evaluation of the lm-eval tasks ``names`` as a search asks for it."""
    return EvalSettings(tasks=tuple(dict.fromkeys(names)), include_path=include_path, limit=limit,
                        num_fewshot=num_fewshot, apply_chat_template=apply_chat_template, device=device).checked()


def lm_group(tasks: tuple[Task, ...], settings: EvalSettings, base: PassModel, index: TaskIndex) -> LmGroup:
    """The group of ``tasks``: lm-eval run once on the base's tokenizer with a scorer that keeps each call's
    scoring (its answers not read: lm-eval's requests do not depend on them)."""
    from resumerge.analyses.evaluation.run import target_max_length, target_tokenizer

    tokenizer = target_tokenizer(base, bool(settings.apply_chat_template))
    group = LmGroup(tasks, settings, tokenizer, target_max_length(base, tokenizer), index, {}, [], {})

    def kept(work: Scoring, kind: str) -> list[Answer]:
        key = (kind, work.digest())
        if key not in group.scorings:
            group.scorings[key], group.first[key] = work, len(group.runs)
            group.runs += [list(run) for run in work.runs]
        return [(0.0, False)] * len(work.run_of)
    _evaluated(group, kept)
    return group


def _evaluated(group: LmGroup, scorer: Callable[[Scoring, str], list[Answer]]) -> Mapping[str, Any]:
    """lm-eval's results of the group's tasks, its requests scored by ``scorer`` (the tasks loaded anew: a task
    object runs once), as ``eval`` runs them."""
    from resumerge.analyses.evaluation.harness import evaluate_tasks
    from resumerge.analyses.evaluation.lm import ResumergeLM
    from resumerge.analyses.evaluation.tasks import loaded_tasks
    from resumerge.analyses.evaluation.yamltasks import yaml_text_tasks

    settings = group.settings
    loaded = loaded_tasks(settings, group.index.manager(settings), quiet=True)
    settings = replace(settings, yaml_texts=yaml_text_tasks(loaded, settings.lm_tasks))
    if settings.yaml_texts:
        raise UsageError(f"task {settings.yaml_texts[0].name} is a text task's YAML",
                         hint="name its texts as an nll task: {nll: {texts: FILE}}")
    lm = ResumergeLM(group.tokenizer, group.max_length, scorer)
    return evaluate_tasks(lm, "the structure search's candidate", settings, loaded.runs(settings), None)

"""resumerge's evaluation through lm-eval's own ``evaluate`` (:mod:`resumerge.analyses.evaluation.harness`) gives
the results object lm-eval's ``simple_evaluate`` gives for the same model and options, key for key and in its order
(the figures, samples, configs, the ``config`` block, the tokenizer's tokens) and with its warnings, but the
description of the machine (torch's ``collect_env``: 1.2 s of CPU an evaluation), which the results file alone
records, where ``simple_evaluate`` places it; its tasks loaded once, when they are checked (before the seeds
``simple_evaluate`` sets before it loads them), and those objects run. Made-up log-likelihoods stand for the forward
pass: a few seconds."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

import transformers

from resumerge.analyses.evaluation.harness import add_environment, evaluate_tasks
from resumerge.analyses.evaluation.lm import ResumergeLM
from resumerge.analyses.evaluation.requests import Scoring
from resumerge.analyses.evaluation.settings import EvalSettings, Seeds
from resumerge.analyses.evaluation.tasks import loaded_tasks
from resumerge.forward.text.texts import tokenizer_at
from tests.evaluation.evaltasks import tiny_model, write_tasks

# What lm-eval's add_env_info puts in a results object: the file's, not the object an evaluation returns.
MACHINE = ["pretty_env_info", "transformers_version", "lm_eval_version", "upper_git_hash"]


def _made_up(work: Scoring, kind: str) -> list[tuple[float, bool]]:
    """A log-likelihood and a greedy flag for each request, from its run and its continuation."""
    return [(-0.5 * len(work.targets[i]) - 0.01 * run, run % 2 == 0) for i, run in enumerate(work.run_of)]


def _plain(doc: dict[str, Any]) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(doc, default=handle_non_serializable, ensure_ascii=False)


@pytest.mark.parametrize("options", [{"num_fewshot": 2, "limit": 3}, {"apply_chat_template": True, "limit": 0.5},
                                     {"num_fewshot": 2, "limit": 3, "seeds": Seeds.parse("5,6,7,8")}],
                         ids=["fewshot", "chat", "seeds"])
def test_the_results_object_is_simple_evaluates_but_the_machine(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 options: dict[str, Any]) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tasks = tiny_model(tmp_path / "model"), write_tasks(tmp_path)
    settings = EvalSettings(tasks=("tiny_mc", "tiny_ppl"), include_path=str(tasks), log_samples=True, **options)
    lm = ResumergeLM(tokenizer_at(transformers, model), 24, _made_up)

    def run(evaluate: Any) -> tuple[dict[str, Any], list[str]]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lm_eval"):
            found = dict(evaluate(TaskManager(include_path=str(tasks), include_defaults=False)))
        return found, [r.getMessage() for r in caplog.records]

    theirs, warned = run(lambda manager: lm_eval.simple_evaluate(
        model=lm, model_args={"pretrained": str(model)}, tasks=list(settings.lm_tasks),
        num_fewshot=settings.num_fewshot, limit=settings.whole_limit, log_samples=True,
        apply_chat_template=settings.apply_chat_template, task_manager=manager, random_seed=settings.seeds.random,
        numpy_random_seed=settings.seeds.numpy, torch_random_seed=settings.seeds.torch,
        fewshot_random_seed=settings.seeds.fewshot))
    loads: list[object] = []

    def loaded_once(manager: Any) -> dict[str, Any]:
        # as run_eval: the tasks loaded when checked (before the harness's seeds), those objects run
        original = manager.load
        manager.load = lambda names: loads.append(names) or original(names)
        return evaluate_tasks(lm, str(model), settings, loaded_tasks(settings, manager).runs(settings), None)

    ours, said = run(loaded_once)
    assert loads == [list(settings.lm_tasks)]  # one load for the check and the run
    assert said == warned
    assert ours["results"]["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]
    assert [k for k in theirs if k not in MACHINE] == list(ours)
    assert _plain({k: v for k, v in ours.items() if k != "date"}) == \
        _plain({k: v for k, v in theirs.items() if k not in [*MACHINE, "date"]})
    assert ours["config"]["fewshot_seed"] == settings.seeds.fewshot
    add_environment(ours)  # as the results file records it: lm-eval's description, where lm-eval puts it
    assert list(ours) == list(theirs)
    assert ours["pretty_env_info"] and all(ours[k] == theirs[k] for k in MACHINE[1:])

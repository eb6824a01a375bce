"""lm-eval task entries of an evolve config scored through ``resumerge eval`` on each candidate's unwritten merge,
beside a ``kl`` task (two scorers, one journal): ``acc`` counts up in the objective as mergekit-evolve weighs it;
a task that generates text is refused in one line before any weight is read, a metric the task does not have in
one line once the first candidate's evaluation shows the task's metrics.

Tiny generated models with a chat template (three layers, width 32) and offline task YAMLs; two generations of two."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from resumerge import api
from resumerge.cli.commands import main
from tests.evaluation.evaltasks import tiny_model, write_tasks

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lmeval")
    for seed, name in enumerate(("base", "a", "b")):
        tiny_model(root / name, seed=seed, context=64)
    write_tasks(root)
    (root / "a.txt").write_text("alpha beta gamma delta\nsigma omega rho tau\n")
    return root


def _config(root: Path, tasks: list[object]) -> Path:
    doc = {"genome": {"models": [str(root / "a"), str(root / "b")], "merge_method": "task_arithmetic",
                      "base_model": str(root / "base")},
           "tasks": tasks, "limit": 4, "apply_chat_template": False}
    path = root / f"evolve-{len(list(root.glob('evolve-*.yml')))}.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_an_lm_eval_task_counts_up_beside_a_kl_task(root: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval.tasks

    built: list[dict[str, Any]] = []

    class Counted(lm_eval.tasks.TaskManager):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counted)
    config = _config(root, [{"name": "tiny_mc", "metric": "acc,none", "weight": 2.0},
                            {"kl": {"parent": str(root / "a"), "texts": str(root / "a.txt")}}])
    outcome = api.evolve(config, tmp_path / "store", search=api.Search(max_fevals=4, popsize=2),
                         task_search_path=root / "tasks")
    assert len(built) == 1  # lm-eval's tasks indexed once: the planning's index serves the four candidates
    rows = [json.loads(line) for line in (tmp_path / "store" / "evaluations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and outcome.generations == 2
    for row in rows:
        acc, kl = row["tasks"]["tiny_mc"], row["tasks"]["kl:a:a.txt"]
        assert 0.0 <= acc <= 1.0 and kl > 0
        assert math.isclose(row["objective"], -2.0 * acc + kl, rel_tol=1e-12)
    first = rows[0]["config"]
    report = api.evaluate(_yaml(tmp_path / "first.yml", first), ["tiny_mc"], api.Settings(state_dir=tmp_path / "state"),
                          harness=api.Harness(include_path=root / "tasks", limit=4))
    assert report.metric("tiny_mc", "acc") == rows[0]["tasks"]["tiny_mc"]  # its own index: the same figure
    assert len(built) == 2


def test_a_task_index_builds_once_and_travels_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    from resumerge.analyses.evaluation import tasks
    from resumerge.analyses.evaluation.settings import EvalSettings

    built: list[EvalSettings] = []

    def manager(settings: EvalSettings) -> object:
        built.append(settings)
        return lambda: settings  # not picklable, as lm-eval's manager need not be

    monkeypatch.setattr(tasks, "task_manager", manager)
    index = tasks.TaskIndex()
    first = index.manager(EvalSettings(tasks=("tiny_mc",)))
    assert index.manager(EvalSettings(tasks=("tiny_mc",), limit=4)) is first and len(built) == 1
    assert index.manager(EvalSettings(tasks=("tiny_mc",), include_path=str(tmp_path))) is not first
    assert len(built) == 2  # another include path: another manager
    assert pickle.loads(pickle.dumps(index)).manager(EvalSettings(tasks=("tiny_mc",))) is not first  # rebuilt


def _yaml(path: Path, doc: object) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize(("task", "says"), [({"name": "tiny_gen"}, "task tiny_gen generates text"),
                                             ({"name": "tiny_mc", "metric": "f1,none"}, "no metric f1,none")])
def test_a_generating_task_or_a_missing_metric_is_one_line(root: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str], task: object,
                                                          says: str) -> None:
    config = _config(root, [task])
    store = tmp_path / "store"
    assert main(["evolve", str(config), str(store), "--max-fevals", "1", "--popsize", "2", "--task-search-path",
                 str(root / "tasks")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # datasets' own progress lines may come before
    assert says in lines[-1] and lines[-1].startswith("error: ") and sum("error" in x for x in lines) == 1, lines

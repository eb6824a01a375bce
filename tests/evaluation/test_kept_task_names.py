"""An unknown task is refused from the names of lm-eval's own tasks kept in the installation's cache, without lm-eval's
``TaskManager`` (which indexes ~14,700 task YAMLs first): the same line, exit 2; a known name still goes through it;
a kept set written for another listing of lm-eval's tasks folder is never trusted. lm-eval's folder is a test's own
here (its listing the key) and its ``TaskManager`` a stand-in that counts its builds: the cost checked by structure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from support import cli_here

from resumerge.analyses.evaluation import keptnames, tasks
from resumerge.analyses.evaluation.settings import EvalSettings
from resumerge.errors import UsageError
from tests.evaluation.evaltasks import tiny_model

_REFUSED = ("error: unknown task(s) no_such_task: not an lm-eval task, group or tag — list them with lm-eval "
            "--tasks list, or name a folder of task YAMLs with --include-path")


@pytest.fixture
def built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each build of lm-eval's ``TaskManager`` (its keyword arguments), over a tasks folder of the test's own."""
    import lm_eval.tasks

    folder = tmp_path / "lm_eval_tasks"
    (folder / "known").mkdir(parents=True)
    (folder / "known" / "known_task.yaml").write_text("task: known_task\n")
    monkeypatch.setattr(keptnames, "lm_eval_tasks", lambda: ("0.4.13", folder))
    builds: list[dict[str, Any]] = []

    class Counted:  # lm-eval's own names, and an include path's
        def __init__(self, **kwargs: Any) -> None:
            builds.append(kwargs)
            self.all_tasks = ["known_group", "known_task"] if kwargs.get("include_defaults", True) else []
            self.all_tasks += ["their_task"] if kwargs.get("include_path") else []

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counted)
    return builds


def test_an_unknown_task_is_refused_from_the_kept_names_without_lm_evals_index(built: list[dict[str, Any]],
                                                                              tmp_path: Path) -> None:
    first = tasks.task_manager(EvalSettings(tasks=("known_task",)))  # builds the index, keeps its names
    assert len(built) == 1
    done = cli_here("eval", tiny_model(tmp_path / "model"), "--tasks", "no_such_task", "--state-dir",
                    tmp_path / "state")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [_REFUSED]
    assert len(built) == 1  # refused from the kept names: no TaskManager built
    again = tasks.task_manager(EvalSettings(tasks=("known_group",)))
    assert len(built) == 2 and type(again) is type(first)  # a known name: lm-eval's own full path, as before
    with pytest.raises(UsageError, match="unknown task"):
        tasks.task_manager(EvalSettings(tasks=("known_task", "no_such_task")))
    assert len(built) == 2
    assert tasks.task_manager(EvalSettings(tasks=("my/own_task.yaml",))) is not None  # a YAML path: lm-eval's
    assert len(built) == 3


def test_an_include_path_task_is_not_refused_by_the_kept_names(built: list[dict[str, Any]], tmp_path: Path) -> None:
    tasks.task_manager(EvalSettings(tasks=("known_task",)))
    included = tmp_path / "included"
    included.mkdir()
    assert tasks.task_manager(EvalSettings(tasks=("known_task", "their_task"), include_path=str(included)))
    assert [sorted(b) for b in built] == [[], ["include_defaults", "include_path"], ["include_path"]]
    with pytest.raises(UsageError, match=r"unknown task\(s\) x: .*, nor a task YAML in"):
        tasks.task_manager(EvalSettings(tasks=("known_task", "their_task", "x"), include_path=str(included)))
    assert len(built) == 4 and built[3]["include_defaults"] is False  # only the include path's own index built


def test_a_kept_set_of_another_listing_is_not_trusted(built: list[dict[str, Any]], tmp_path: Path) -> None:
    tasks.task_manager(EvalSettings(tasks=("known_task",)))
    kept = keptnames.KeptTaskNames.here()
    assert kept is not None and kept.names() == {"known_group", "known_task"}
    (tmp_path / "lm_eval_tasks" / "known" / "new_task.yaml").write_text("task: new_task\n")  # lm-eval upgraded
    fresh = keptnames.KeptTaskNames.here()
    assert fresh is not None and fresh.key != kept.key and fresh.names() is None
    tasks.task_manager(EvalSettings(tasks=("new_task",)))  # not refused from the old set: the index is built
    assert len(built) == 2
    # a file whose key inside is another's (copied, or a digest that met another) is not read either
    fresh.path.write_text(kept.path.read_text())
    assert fresh.names() is None

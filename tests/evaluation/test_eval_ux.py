"""What a new user of ``resumerge eval`` met on real weights (issue 87, items 7-14), each a test: the flags a
refusal names are flags ``eval`` takes; ``status`` of an evaluation says the evaluation's own figures; lm-eval's
call of git says nothing; the guide's local-data task runs as written; ``--output-path`` names the folder as lm-eval
does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from support import cli_here

from tests.evaluation.evaltasks import tiny_model, write_tasks


def _config(path: Path, *models: Path) -> Path:
    path.write_text("merge_method: linear\ndtype: float32\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters: {{weight: 0.5}}\n" for m in models))
    return path


def test_the_allow_crimes_a_refusal_names_is_a_flag_eval_takes(tmp_path: Path) -> None:
    one, other = tiny_model(tmp_path / "one"), tiny_model(tmp_path / "other", seed=1)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]  # the same tensors, named another architecture
    (other / "config.json").write_text(json.dumps(config))
    tasks, state, merge = write_tasks(tmp_path), tmp_path / "state", _config(tmp_path / "merge.yml", one, other)
    refused = cli_here("eval", merge, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state)
    assert refused.returncode == 2 and "--allow-crimes" in refused.stderr, refused.stderr
    done = cli_here("eval", merge, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state, "--limit",
                    "2", "--allow-crimes", "--json")
    assert done.returncode == 0, done.stderr
    assert "acc,none" in json.loads(done.stdout)["results"]["tiny_mc"]
    # a flag that merges: nothing to merge in a model TARGET
    model = cli_here("eval", one, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state,
                     "--allow-crimes")
    assert model.returncode == 2 and "--allow-crimes applies to a merge config TARGET" in model.stderr, model.stderr


def test_lm_evals_call_of_git_says_nothing_outside_a_clone(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model, tasks = tiny_model(tmp_path / "model"), write_tasks(tmp_path)
    away = tmp_path / "away"
    away.mkdir()
    monkeypatch.chdir(away)  # no repository here or above: git fails, as in a user's folder
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    done = cli_here("eval", model, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", tmp_path / "state",
                    "--limit", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["git_hash"] is None
    said = capfd.readouterr().err  # what the process's stderr got from its children: git's, before
    assert "not a git repository" not in said and "fatal" not in said, said

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


def _until_zombie(pid: int) -> None:
    """Until ``pid`` has ended but is not reaped: a zombie whose every thread is gone (its files, its locks closed
    with the last one)."""
    import os
    import time

    for _ in range(1200):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"{pid} never ended")


def test_status_of_an_evaluation_says_its_layers_and_requests_and_a_killed_one_is_interrupted(
        tmp_path: Path) -> None:
    from resumerge import api
    from resumerge.cli.statusshow import show_status
    from tests.support import cli_start, wait_stopped

    model, tasks, state = tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    argv = ["eval", model, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state, "--json"]
    # a process of this test's own, forked (not reaped until the test reads its status): killed, it stays a zombie
    # whose pid answers
    first = cli_start(*argv, env={"RESUMERGE_STOP_AT": "after_eval_layer"})
    try:
        wait_stopped(first, timeout=240)
        running = api.status(model, settings=api.Settings(state_dir=state))
        assert running.state == "running" and running.resume_command is None
        first.kill()  # SIGKILL, not yet reaped: the pid still "exists", the pass's lock is gone
        _until_zombie(first.pid)
        found = api.status(model, settings=api.Settings(state_dir=state))
    finally:
        first.kill()
        first.wait()
    assert found.state == "interrupted" and found.resume_command is not None, found
    assert found.resume_command.startswith(f"resumerge eval {model} --tasks tiny_mc")
    text = str(found)
    assert "layers       1 of 3 journaled of the loglikelihood pass" in text, text
    assert "requests     0 of 24 answered by the loglikelihood pass" in text, text
    for merge_word in ("shards", "tensors", "bytes", "% of bytes"):
        assert merge_word not in text, text
    out = __import__("io").StringIO()
    show_status(found, out, width=200)
    shown = out.getvalue()
    assert "layers" in shown and "journaled of the loglikelihood pass" in shown and "finish with" in shown
    assert "shards" not in shown and "% of bytes" not in shown and "tensors" not in shown, shown


def _guide_example() -> tuple[str, str, list[str]]:
    """docs/eval.md's task over local data: its YAML, its JSONL and its command's words, as printed."""
    guide = (Path(__file__).parents[2] / "docs" / "eval.md").read_text(encoding="utf-8")
    section = guide.split("### A task over your own data (no hub)", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]  # the fenced blocks' bodies, each after its info string
    yaml, jsonl, command = (block.split("\n", 1)[1] for block in blocks[:3])
    assert blocks[0].startswith("yaml") and blocks[1].startswith("jsonl"), blocks
    return yaml, jsonl, command.split()


def test_the_docs_task_over_local_data_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    yaml, jsonl, command = _guide_example()
    assert len(yaml.strip().splitlines()) <= 10
    (tmp_path / "tasks").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "tasks" / "capitals.yaml").write_text(yaml)
    (tmp_path / "data" / "capitals.jsonl").write_text(jsonl)
    tiny_model(tmp_path / "merged")
    monkeypatch.chdir(tmp_path)  # "in the folder holding tasks/ and data/"
    assert command[:2] == ["resumerge", "eval"]
    done = cli_here(*command[1:], "--state-dir", tmp_path / "state", "--json")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert set(results["results"]["capitals"]) >= {"acc,none", "acc_norm,none"}
    assert results["n-samples"]["capitals"]["effective"] == len(jsonl.strip().splitlines()) == 3


def test_output_path_names_the_results_folder_after_the_models_own_name(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``eval merged/ --output-path res`` wrote ``res/merged__/`` and ``eval ../out --output-path r`` the hidden
    ``r/..__out/`` (issue 97, item 7): a local model's results go in a folder of its own name, its resolved path's,
    through a text task alone as through an lm-eval task."""
    merged, out = tiny_model(tmp_path / "merged"), tiny_model(tmp_path / "out", seed=1)
    tasks, texts = write_tasks(tmp_path), tmp_path / "texts.txt"
    texts.write_text("alpha beta gamma\ndelta epsilon\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    done = cli_here("eval", "merged/", "--tasks", f"nll:{texts}", "--state-dir", tmp_path / "state",
                    "--output-path", "res")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "res").iterdir()] == [merged.name]
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    done = cli_here("eval", "../out", "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir",
                    tmp_path / "state", "--limit", "2", "--output-path", "r")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "work" / "r").iterdir()] == [out.name]


def test_a_hub_models_results_folder_is_named_as_lm_eval_names_it() -> None:
    from resumerge.analyses.evaluation.outputs import results_folder

    assert results_folder("hf://org/name") == "org__name" == results_folder("org/name")


def test_max_memory_is_judged_when_the_answer_comes_from_the_journal(tmp_path: Path) -> None:
    model, tasks, state = tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    argv = [model, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state, "--limit", "2", "--json"]
    first = cli_here("eval", *argv)
    assert first.returncode == 0, first.stderr
    again = cli_here("eval", *argv, "--max-memory", "1MB")  # journaled: answered before, whatever the budget
    assert again.returncode == 2 and "more than the budget of 1.00 MB" in again.stderr, again.stderr
    last = cli_here("eval", *argv)  # and without it, answered from the journal as before
    assert json.loads(last.stdout)["results"] == json.loads(first.stdout)["results"]

"""``check``'s NLL and KL as tasks of ``eval`` (``nll:FILE``, ``kl:PARENT:FILE``): the figures equal ``check``'s on
the same model and texts, sit in lm-eval's results object beside its own tasks, are answered from the journal when
asked again, and a malformed or missing one is one line before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from resumerge import api
from resumerge.analyses.evaluation.texttasks import KL, NLL, TextTask, text_task
from resumerge.errors import UsageError
from tests.evaluation.evaltasks import WORDS, tiny_model, write_tasks


def _texts(path: Path) -> Path:
    lines = [" ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + 2 * i)) for i in range(5)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_words_name_text_tasks_and_nothing_else() -> None:
    assert text_task("nll:a.txt") == TextTask(NLL, "a.txt", None, "nll:a.txt")
    assert text_task("kl:hf://org/name@main:t.txt") == TextTask(KL, "t.txt", "hf://org/name@main",
                                                                "kl:hf://org/name@main:t.txt")
    assert text_task("hellaswag") is None and text_task("arc:easy") is None
    for bad in ("nll:", "kl:t.txt", "kl::t.txt", "kl:p:"):
        with pytest.raises(UsageError):
            text_task(bad)


def test_nll_and_kl_tasks_equal_checks_figures_beside_lm_evals_tasks(tmp_path: Path) -> None:
    model, parent = tiny_model(tmp_path / "model"), tiny_model(tmp_path / "parent", seed=1)
    tasks, texts = write_tasks(tmp_path), _texts(tmp_path / "texts.txt")
    names = [f"nll:{texts}", f"kl:{parent}:{texts}", "tiny_mc"]
    state = tmp_path / "state"
    report = api.evaluate(model, names, api.Settings(state_dir=state), harness=api.Harness(include_path=tasks, limit=2))
    checked = api.check(model, parents=[parent], prompts=texts, truncate_texts=True,
                        settings=api.Settings(state_dir=tmp_path / "check"))
    results = report.to_json()
    assert set(results["results"]) == set(names)
    assert results["results"][names[0]]["nll,none"] == pytest.approx(checked.models[0].nll, abs=1e-6)
    assert results["results"][names[1]]["kl,none"] == pytest.approx(checked.models[1].kl, abs=1e-6)
    assert results["results"][names[1]]["kl,none"] > 0
    assert results["higher_is_better"][names[0]] == {"nll": False}
    assert results["configs"][names[1]]["parent"] == str(parent) and names[0] in results["versions"]
    assert "nll" in report.table() and "tiny_mc" in report.table()
    again = api.evaluate(model, names[:2], api.Settings(state_dir=state),
                         progress=lambda step: pytest.fail(f"a finished pass ran again: {step}"))
    assert again.to_json()["results"] == {n: results["results"][n] for n in names[:2]}


def test_text_tasks_alone_write_lm_evals_results_file(tmp_path: Path) -> None:
    model, texts = tiny_model(tmp_path / "model"), _texts(tmp_path / "texts.txt")
    report = api.evaluate(model, f"nll:{texts}", api.Settings(state_dir=tmp_path / "state"),
                          harness=api.Harness(output_path=tmp_path / "out"))
    (written,) = report.written
    assert json.loads(Path(written).read_text())["results"][f"nll:{texts}"]["nll,none"] == report.metric(
        f"nll:{texts}", "nll")


def test_a_missing_texts_file_is_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such texts file"):
        api.evaluate(tmp_path / "nowhere", f"nll:{tmp_path / 'absent.txt'}", api.Settings(state_dir=tmp_path / "state"))


@pytest.mark.slow
def test_a_killed_text_task_resumes_at_its_layer_with_the_same_figure(tmp_path: Path) -> None:
    import signal

    from tests.support import cli

    model, texts, state = tiny_model(tmp_path / "model"), _texts(tmp_path / "texts.txt"), tmp_path / "state"
    argv = ["eval", model, "--tasks", f"nll:{texts}", "--state-dir", state, "--json"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_eval_layer:2"}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "layer 2/3" in killed.stderr and "layer 3/3" not in killed.stderr
    resumed = cli(*argv, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "layer 3/3" in resumed.stderr and "layer 1/3" not in resumed.stderr
    whole = api.evaluate(model, f"nll:{texts}", api.Settings(state_dir=tmp_path / "whole"))
    assert json.loads(resumed.stdout)["results"] == whole.to_json()["results"]


def test_a_kl_parent_of_another_vocabulary_is_measured_over_the_shared_tokens_as_check_does(tmp_path: Path) -> None:
    # The parent's vocabulary extends the model's (80 rows against 64: a union merge's); before, eval refused the
    # task ("tokenize differently") where check compares them over the 64 tokens both hold.
    from resumerge.cli.modelgen import ModelSpec, make_model

    model = tiny_model(tmp_path / "model")
    parent = make_model(tmp_path / "parent", ModelSpec(layers=3, hidden=32, intermediate=48, vocab=80), seed=1)
    texts = _texts(tmp_path / "texts.txt")
    names = [f"nll:{texts}", f"kl:{parent}:{texts}"]
    report = api.evaluate(model, names, api.Settings(state_dir=tmp_path / "state"))
    checked = api.check(model, parents=[parent], prompts=texts, truncate_texts=True,
                        settings=api.Settings(state_dir=tmp_path / "check"))
    results = report.to_json()
    assert checked.shared_tokens == 64
    assert results["results"][names[0]]["nll,none"] == pytest.approx(checked.models[0].nll, abs=1e-6)
    assert results["results"][names[1]]["kl,none"] == pytest.approx(checked.models[1].kl, abs=1e-6)
    assert results["results"][names[1]]["kl,none"] > 0
    assert results["configs"][names[1]]["vocabulary"].startswith("64 tokens shared")


def test_a_text_task_written_as_an_lm_eval_task_yaml_equals_the_same_task_named_on_the_command_line(
        tmp_path: Path) -> None:
    model, parent = tiny_model(tmp_path / "model"), tiny_model(tmp_path / "parent", seed=1)
    tasks, texts = write_tasks(tmp_path), _texts(tmp_path / "texts.txt")
    head = "class: !function resumerge.analyses.evaluation.yamltasks.TextsTask\n"
    (tasks / "own_nll.yaml").write_text(f"task: own_nll\n{head}metric: nll\ntexts: {texts}\n")
    (tasks / "own_kl.yaml").write_text(f"task: own_kl\n{head}metric: kl\ntexts: {texts}\nparent: {parent}\n")
    (tasks / "bad_kl.yaml").write_text(f"task: bad_kl\n{head}metric: kl\ntexts: {texts}\n")
    state = tmp_path / "state"
    report = api.evaluate(model, "own_nll,own_kl", api.Settings(state_dir=state),
                          harness=api.Harness(include_path=tasks))
    results = report.to_json()["results"]
    assert set(results) == {"own_nll", "own_kl"}
    named = api.evaluate(model, [f"nll:{texts}", f"kl:{parent}:{texts}"], api.Settings(state_dir=state),
                         progress=lambda step: pytest.fail(f"the same pass ran again: {step}"))
    assert results["own_nll"]["nll,none"] == named.metric(f"nll:{texts}", "nll")
    assert results["own_kl"]["kl,none"] == named.metric(f"kl:{parent}:{texts}", "kl") > 0
    with pytest.raises(UsageError, match="task bad_kl: kl needs a parent"):
        api.evaluate(model, "bad_kl", api.Settings(state_dir=state), harness=api.Harness(include_path=tasks))

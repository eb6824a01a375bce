"""Bad input to ``resumerge eval`` is one line and exit 2 before any weight is read (nothing journaled): an unknown
task, a task whose data file is missing (offline), tasks that load alone but not together, ``--limit 0``, a
``--seed`` lm-eval would not read, a generation task whose budget holds none of its layers or whose generation kwargs
ask what resumerge does not honour, a merge config as TARGET, a folder that is not a model, and a
budget the pass cannot fit. In this process (the CLI's main): a second or two each, lm-eval's task index built from
the test's folder only."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from support import cli_here

from tests.evaluation.evaltasks import tiny_model, write_tasks


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    return tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"


def _refused(*args: str | Path) -> str:
    done = cli_here("eval", *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: "), done.stderr
    return lines[-1]


def test_an_unknown_task_is_named(setup: tuple[Path, Path, Path]) -> None:
    model, tasks, state = setup
    line = _refused(model, "--tasks", "tiny_mc,no_such_task", "--include-path", tasks, "--state-dir", state)
    assert "unknown task(s) no_such_task" in line
    assert not (state / "evals").exists()


def test_a_task_whose_data_is_missing_is_named_with_why(setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model, tasks, state = setup
    (tmp_path / "data" / "ppl.jsonl").unlink()
    line = _refused(model, "--tasks", "tiny_ppl", "--include-path", tasks, "--state-dir", state)
    assert line.startswith("error: task tiny_ppl cannot be loaded: ") and "offline" in line
    assert not (state / "evals").exists()


def test_tasks_that_load_alone_but_not_together_are_named(setup: tuple[Path, Path, Path]) -> None:
    model, tasks, state = setup
    (tasks / "tiny_group.yaml").write_text("group: tiny_group\ntask: [tiny_mc]\n")
    line = _refused(model, "--tasks", "tiny_group,tiny_mc", "--include-path", tasks, "--state-dir", state)
    assert line.startswith("error: tasks tiny_group, tiny_mc cannot be loaded together: ") and "tiny_mc" in line
    assert not (state / "evals").exists()


@pytest.mark.parametrize(("flag", "value", "said"), [("--limit", "0", "--limit 0 is not a number of documents"),
                                                     ("--limit", "2.5", "--limit 2.5 is not a number of documents"),
                                                     ("--num-fewshot", "-1", "--num-fewshot -1 is below 0"),
                                                     ("--seed", "1,2", "--seed 1,2 is not lm-eval's seeds")])
def test_a_wrong_option_is_named(setup: tuple[Path, Path, Path], flag: str, value: str, said: str) -> None:
    model, tasks, state = setup
    line = _refused(model, "--tasks", "tiny_mc", "--include-path", tasks, flag, value, "--state-dir", state)
    assert said in line


def test_a_generation_task_the_budget_cannot_hold_a_layer_of_is_refused_naming_it(setup: tuple[Path, Path, Path]
                                                                                   ) -> None:
    model, tasks, state = setup
    line = _refused(model, "--tasks", "tiny_mc,tiny_gen", "--include-path", tasks, "--max-memory", "1MB",
                    "--state-dir", state)
    assert "tiny_gen generate text (generate_until), one decoder layer at a time where the whole model" in line
    assert "tiny_mc" not in line.split("—")[0]
    assert not (state / "evals").exists()


def test_a_generation_kwarg_resumerge_does_not_honour_is_named_before_a_weight_is_read(
        setup: tuple[Path, Path, Path]) -> None:
    model, tasks, state = setup
    gen = (tasks / "tiny_gen.yaml").read_text()
    (tasks / "tiny_gen.yaml").write_text(gen.replace("max_gen_toks: 8}", "max_gen_toks: 8, num_beams: 4}"))
    line = _refused(model, "--tasks", "tiny_mc,tiny_gen", "--include-path", tasks, "--state-dir", state)
    assert "tiny_gen's generation_kwargs num_beams=4: resumerge does not honour it" in line
    assert not (state / "evals").exists()


def test_a_config_that_does_not_plan_or_a_folder_that_is_no_model_is_refused(setup: tuple[Path, Path, Path],
                                                                             tmp_path: Path) -> None:
    model, tasks, state = setup
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: no_such_method\nmodels:\n  - model: {model}\n")
    line = _refused(config, "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state)
    assert "no_such_method" in line
    line = _refused(tmp_path / "nowhere", "--tasks", "tiny_mc", "--include-path", tasks, "--state-dir", state)
    assert "no such model folder" in line
    assert not (state / "evals").exists()


def test_a_budget_the_pass_cannot_fit_is_refused_before_its_first_layer(setup: tuple[Path, Path, Path]) -> None:
    model, tasks, state = setup
    line = _refused(model, "--tasks", "tiny_mc", "--include-path", tasks, "--max-memory", "1MB", "--state-dir",
                    state)
    assert "the evaluation" in line and "--max-memory" in line
    assert not list(state.glob("evals/*/layer-*.safetensors"))


def test_evaluate_takes_one_settings_and_refuses_the_groups_an_evaluation_cannot_honour(tmp_path: Path) -> None:
    """evaluate takes the Settings run takes (issue 83: 18 parameters before): what writes a run (output, hub,
    stages) and the resources a pass does not use are refused by name, exit 2, before anything is read; lm-eval's
    options are one Harness."""
    from resumerge import api
    from resumerge.api.options import Hub, Output, Resources, Stages
    from resumerge.errors import UsageError

    for settings, name in ((api.Settings(resources=Resources(num_threads=2)), "num_threads"),
                           (api.Settings(output=Output(out_type="gguf")), "output"),
                           (api.Settings(hub=Hub(public=True)), "hub"),
                           (api.Settings(stages=Stages(cleanup_intermediates=True)), "stages"),
                           (api.Settings(merging=api.Merging(allow_same_experts=True)), "allow_same_experts")):
        with pytest.raises(UsageError, match=f"{name} does not apply to evaluate") as refused:
            api.evaluate(tmp_path / "nowhere", "x", settings, harness=api.Harness(limit=2))
        assert refused.value.exit_code == 2
    with pytest.raises(UsageError, match="max_gpu_memory does not apply to evolve"):
        api.evolve(tmp_path / "c.yml", tmp_path / "s", settings=api.Settings(resources=Resources(max_gpu_memory="1GB")))

"""An evaluation killed (SIGKILL) after a decoder layer resumes at the next layer when run again and ends with the
results of one never interrupted; Ctrl-C exits 3 naming the layer reached and the command that continues, which
``status TARGET`` shows too; asked again, a finished evaluation is answered from its journal. Real subprocesses on a
tiny generated model: each a few seconds on a quiet machine (lm-eval's and torch's imports)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from resumerge import api
from tests.evaluation.evaltasks import tiny_model, write_tasks
from tests.support import cli, stopped_at


def _argv(model: Path, tasks: Path, state: Path) -> list[str | Path]:
    return ["eval", model, "--tasks", "tiny_mc,tiny_ppl", "--include-path", tasks, "--state-dir", state, "--json"]


@pytest.mark.slow
def test_a_killed_evaluation_resumes_at_its_layer_with_the_same_results(tmp_path: Path) -> None:
    model, tasks, state = tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    killed = cli(*_argv(model, tasks, state), env={"RESUMERGE_KILL_AT": "after_eval_layer:2"}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "layer 2/3" in killed.stderr and "layer 3/3" not in killed.stderr
    resumed = cli(*_argv(model, tasks, state), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    first = resumed.stderr.split("loglikelihood pass", 1)[1].split("\n")[0]
    assert "layer 3/3" in first and "layer 1/3" not in resumed.stderr.split("loglikelihood_rolling")[0]
    whole = api.evaluate(model, ["tiny_mc", "tiny_ppl"], api.Settings(state_dir=tmp_path / "whole"),
                         harness=api.Harness(include_path=tasks))
    assert json.loads(resumed.stdout)["results"] == whole.to_json()["results"]
    again = api.evaluate(model, ["tiny_mc", "tiny_ppl"], api.Settings(state_dir=tmp_path / "whole"),
                         harness=api.Harness(include_path=tasks),
                         progress=lambda step: pytest.fail(f"a finished pass ran again: {step}"))
    assert again.to_json()["results"] == whole.to_json()["results"]


def test_ctrl_c_exits_3_naming_the_command_that_continues_and_status_shows_it(tmp_path: Path) -> None:
    model, tasks, state = tiny_model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    # Stopped where layer 1's journal is durable (no pause to outlast: on a loaded machine a Ctrl-C sent after one
    # reached the next layer), Ctrl-C'd there, continued.
    with stopped_at("after_eval_layer", *_argv(model, tasks, state), timeout=240, finish=120) as first:
        running = api.status(model, settings=api.Settings(state_dir=state))
        assert (running.kind, running.state) == ("eval", "running")
        first.process.send_signal(signal.SIGINT)  # delivered as it continues, where it stopped
    err = first.err
    assert first.returncode == 3, err
    command = (f"resumerge eval {model} --tasks tiny_mc,tiny_ppl --include-path {tasks} --state-dir {state}")
    line = err.strip().splitlines()[-1]
    assert line == (f"error: the evaluation of {model} was interrupted after layer 1 of 3 of its loglikelihood pass "
                    f"(layers 1-1 journaled) — finish it with: {command}"), err
    found = api.status(model, settings=api.Settings(state_dir=state))
    assert (found.kind, found.state, found.resume_command) == ("eval", "interrupted", command)
    assert found.details is not None and "tiny_mc, tiny_ppl: loglikelihood pass" in found.details.rows[0][1]

"""What a check tells a person as it runs (issue 70, item 7): one line per layer on stderr in a log (the layer, the
models, the tokens, the model running, the time left), a bar in a terminal; Ctrl-C names the layer reached and the
command that continues, which then finishes with the report a check run whole gives.

Real subprocesses on tiny generated models (three layers, width 32): a second or two each."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from support import cli, cli_start

from resumerge.analyses.check.progress import Step
from resumerge.cli.checkprogress import CheckProgress
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=3, hidden=32, intermediate=48, vocab=64)
TEXTS = "the cat sat on the mat\nhello world again and again\n"


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path, Path]:
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    return make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1), texts


def test_a_logged_check_prints_a_line_per_layer(models: tuple[Path, Path, Path], tmp_path: Path) -> None:
    merge, parent, texts = models
    done = cli("check", merge, "--parent", parent, "--prompts", texts, "--json", "--state-dir", tmp_path / "state",
               timeout=300)
    assert done.returncode in (0, 5, 6), done.stderr
    tokens = json.loads(done.stdout)["tokens"]
    lines = [line for line in done.stderr.splitlines() if line.startswith("check: layer")]
    assert [line.split(" (")[0] for line in lines] == [f"check: layer {n} of 3" for n in (1, 2, 3)], done.stderr
    assert all(f"(2 models, {tokens:,} tokens each; now model " in line for line in lines)
    assert all(re.search(r"about .+ left$", line) for line in lines[1:]), lines
    assert "check: the static pass" in done.stderr and "check: the heads" in done.stderr
    quiet = cli("check", merge, "--parent", parent, "--prompts", texts, "--quiet", "--state-dir", tmp_path / "other",
                timeout=300)
    assert "check:" not in quiet.stderr and "verdict:" in quiet.stdout


def test_a_terminal_gets_a_bar_of_layers_and_models() -> None:
    import io

    stream = io.StringIO()
    view = CheckProgress(stream=stream, mode="live")
    for layer in range(2):
        for m in range(2):
            view(Step("m", "forward", layer, 2, m, 2, ("merge", "parent")[m], "x", 100))
    view(Step("m", "done", None, 2, None, 2, None, None, 100))
    shown = stream.getvalue()
    assert "check" in shown and "4/4" in shown and "layer 2/2, model 2/2: parent, 100 tokens" in shown


@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_ctrl_c_names_the_layer_reached_and_the_command_that_continues(models: tuple[Path, Path, Path],
                                                                      tmp_path: Path) -> None:
    merge, parent, texts = models
    state = tmp_path / "state"
    argv = ["check", merge, "--parent", parent, "--prompts", texts, "--json", "--state-dir", state]
    first = cli_start(*argv, env={"RESUMERGE_PAUSE_AT": "after_check_layer:30"}, capture=True)
    try:
        deadline = time.monotonic() + 120
        while not list(state.glob("checks/*/layer-00000.safetensors")) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)  # paused after layer 1's journal: Ctrl-C
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 3, err
    line = err.strip().splitlines()[-1]
    command = f"resumerge check {merge} --parent {parent} --prompts {texts} --state-dir {state}"
    assert line == (f"error: the check of {merge} was interrupted after layer 1 of 3 (layer 1 journaled) — finish it "
                    f"with: {command}"), err
    # ``status`` follows the check of any model (this one is no resumerge output), and says how to continue it.
    from resumerge import api

    found = api.status(merge, settings=api.Settings(state_dir=state))
    assert (found.kind, found.state, found.resume_command) == ("check", "interrupted", command)
    assert found.details is not None and found.details.rows[0] == (
        "check", f"interrupted: layer 1 of 3, model 2 of 2 (parent {parent})")
    # and the thread count its pass computes with, recorded as it first started: the resume computes with it too
    threads = json.loads(next(state.glob("checks/*/threads.json")).read_text())["threads"]
    assert found.details.rows[1:] == (
        ("threads", f"{threads} torch thread{'s' if threads != 1 else ''} (decided at its first start, kept on a "
                    "resume)"),)
    resumed = cli(*command.split()[1:], "--json", timeout=300)
    assert resumed.returncode in (0, 5, 6), resumed.stderr
    assert "check: layer 1 of 3" not in resumed.stderr and "check: layer 2 of 3" in resumed.stderr
    found = api.status(merge, settings=api.Settings(state_dir=state))
    assert (found.kind, found.state, found.resume_command) == ("check", "done", None)
    whole = cli(*argv[:-1], tmp_path / "whole", timeout=300)
    doc, again = json.loads(resumed.stdout), json.loads(whole.stdout)
    assert Path(doc.pop("chart")).read_bytes() == Path(again.pop("chart")).read_bytes()
    assert doc == again


class _Said:
    """A run's reporter that keeps the lines it is told."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def start(self, **_: int) -> None: ...

    def tensor_done(self, name: str, nbytes: int) -> None: ...

    def file_done(self, name: str, kind: str) -> None: ...

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None: ...

    def memory_budget(self, nbytes: int) -> None: ...

    def message(self, text: str) -> None:
        self.lines.append(text)


def test_run_check_tells_the_runs_reporter_a_line_per_layer(models: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from resumerge import api

    merge, parent, _ = models
    config = tmp_path / "merge.yml"
    config.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {p}\n    parameters: {{weight: 0.5}}\n" for p in (merge, parent)))
    said = _Said()
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "state"), check=True, progress=said)
    layers = [line.split(" (")[0] for line in said.lines if line.startswith("check: layer")]
    assert layers == [f"check: layer {n} of 3" for n in (1, 2, 3)], said.lines

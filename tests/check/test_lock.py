"""One process per check and per measurement: a second one started while the first runs exits 4 naming the first
(its pid and command), and never deletes the first's journal under it; the first ends with the report a check run
alone gives. Real subprocesses on tiny generated models (two layers, width 32): a second each."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from forkserver import Forked
from support import cli, cli_start

from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
VERDICTS = (0, 5, 6)  # works, no effect, broken: two random models are what they are, the same each time
TEXTS = "the cat sat on the mat\nhello world again and again\n"


def _wait_for(path: Path, process: Forked | subprocess.Popen[str], text: str = "") -> None:
    """Until ``path`` holds ``text`` (the first process got where the test needs it)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        if process.poll() is not None:
            raise AssertionError(f"the first process ended first: {process.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"{path} never held {text!r}")


@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_a_second_check_of_the_same_models_exits_4_naming_the_first(tmp_path: Path) -> None:
    merge, parent = make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    state = tmp_path / "state"
    args = ("check", merge, "--parent", parent, "--prompts", texts, "--json", "--state-dir", state)
    # The first pauses after each layer's journal is saved: the second comes while it holds the journal.
    # Forked from the worker's fork server; the second, started while the server runs the first, is a fresh one.
    first = cli_start(*args, env={"RESUMERGE_PAUSE_AT": "after_check_layer:3"}, capture=True)
    try:
        journal = next(iter(state.glob("checks/*/progress.json")), None)
        deadline = time.monotonic() + 120
        while journal is None and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
            journal = next(iter(state.glob("checks/*/progress.json")), None)
        assert journal is not None, first.communicate()
        _wait_for(journal, first, '"phase": "forward"')
        second = cli(*args, timeout=300)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 4, second.stderr
    line = second.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"pid {first.pid}: resumerge check {merge} --parent {parent}" in line, line
    alone = cli(*args[:-1], tmp_path / "alone", timeout=300)
    assert alone.returncode in VERDICTS, alone.stderr[-3000:]
    assert first.returncode == alone.returncode, err[-3000:]  # the verdict's exit code (two random models)
    doc, again = json.loads(out), json.loads(alone.stdout)
    assert Path(doc.pop("chart")).read_bytes() == Path(again.pop("chart")).read_bytes()
    assert doc == again
    # Asked again once the first is done, the check answers from its report.
    third = cli(*args, timeout=300)
    assert third.returncode == first.returncode and json.loads(third.stdout)["verdict"] == doc["verdict"]


@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_a_second_measurement_into_the_same_folder_exits_4_naming_the_first(tmp_path: Path) -> None:
    a, b = make_model(tmp_path / "a", SPEC, seed=0), make_model(tmp_path / "b", SPEC, seed=1)
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: regmean\nmodels:\n  - model: {a}\n  - model: {b}\n")
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    out = tmp_path / "grams"
    args = ("measure", config, out, "--texts", texts)
    first = cli_start(*args, env={"RESUMERGE_PAUSE_AT": "after_measure_layer:3"}, capture=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("model-*/layer-*.safetensors")) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        from resumerge import api

        assert api.status(out).state == "running" and api.status(out).resume_command is None
        # Held still while the second one starts: its pauses alone (3 s a layer) do not outlast a loaded machine's
        # interpreter start; a stopped process keeps its lock, as a slow one would.
        first.send_signal(signal.SIGSTOP)
        try:
            second = cli(*args, timeout=300)
        finally:
            first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 4, second.stderr
    assert f"pid {first.pid}: resumerge measure {config} {out}" in second.stderr, second.stderr
    assert first.returncode == 0, err[-3000:]
    assert (out / "measure.json").is_file()
    done = cli(*args, timeout=300)
    assert done.returncode == 0, done.stderr

"""One process per check and per measurement: a second one started while the first runs exits 4 naming the first
(its pid and command), and never deletes the first's journal under it; the first ends with the report a check run
alone gives. The first is a real subprocess, held at its first layer (stopped: it keeps its lock and journal)
while the second, this test's own process, asks; tiny generated models (two layers, width 32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import cli, cli_here, stopped_at

from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
VERDICTS = (0, 5, 6)  # works, no effect, broken: two random models are what they are, the same each time
TEXTS = "the cat sat on the mat\nhello world again and again\n"


@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_a_second_check_of_the_same_models_exits_4_naming_the_first(tmp_path: Path) -> None:
    merge, parent = make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1)
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    state = tmp_path / "state"
    args = ("check", merge, "--parent", parent, "--prompts", texts, "--json", "--state-dir", state)
    # The first stops itself once its first layer's journal is saved: the second comes while it holds the journal
    # and its lock (a stopped process keeps both, as a slow one would), with no sleep to outlast.
    with stopped_at("after_check_layer:1", *args) as first:
        (journal,) = state.glob("checks/*/progress.json")
        assert '"phase": "forward"' in journal.read_text()
        second = cli_here(*args)  # a process of its own (this one), not the first's
    out, err = first.out, first.err
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
    # its first layer durable, its lock held: a stopped process keeps it, as a slow one would
    with stopped_at("after_measure_layer:1", *args) as first:
        assert list(out.glob("model-*/layer-*.safetensors"))
        from resumerge import api

        assert api.status(out).state == "running" and api.status(out).resume_command is None
        second = cli_here(*args)  # a process of its own (this one), not the first's
    err = first.err
    assert second.returncode == 4, second.stderr
    assert f"pid {first.pid}: resumerge measure {config} {out}" in second.stderr, second.stderr
    assert first.returncode == 0, err[-3000:]
    assert (out / "measure.json").is_file()
    done = cli(*args, timeout=300)
    assert done.returncode == 0, done.stderr

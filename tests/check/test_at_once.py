"""Two checks of the same models at once, each over its own texts (two pass folders under one state dir, sharing its
token cache and the models' files): each ends with the report the same check run alone gives. Real subprocesses,
started together, on tiny generated models (two layers, width 32); each alone in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import cli_start

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
TEXTS = ("the cat sat on the mat\nhello world again and again\n", "one two three four five\nsix seven eight\n")


def test_two_checks_of_the_same_models_at_once_each_end_with_their_own_report(tmp_path: Path) -> None:
    merge, parent = make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1)
    texts = []
    for i, text in enumerate(TEXTS):
        texts.append(tmp_path / f"texts{i}.txt")
        texts[-1].write_text(text)

    def args(i: int, state: Path) -> list[str | Path]:
        return ["check", merge, "--parent", parent, "--prompts", texts[i], "--json", "--state-dir", state]

    # Each pauses after each layer's journal is saved: the two passes run side by side.
    # The first forked from the worker's fork server, the second (the server busy with the first) a fresh one.
    paused = {"RESUMERGE_PAUSE_AT": "after_check_layer:0.5"}
    together = [cli_start(*args(i, tmp_path / "shared"), env=paused, capture=True) for i in range(2)]
    found = [p.communicate(timeout=300) for p in together]
    for i, (process, (out, err)) in enumerate(zip(together, found)):
        alone = api.check(merge, parents=[parent], prompts=texts[i],
                          settings=api.Settings(state_dir=tmp_path / f"alone{i}"))  # here
        assert process.returncode == alone.exit_code, err[-3000:]
        doc, again = json.loads(out), json.loads(json.dumps(alone.to_json()))
        assert Path(doc.pop("chart")).read_bytes() == Path(again.pop("chart")).read_bytes()
        assert doc == again
    assert len(list((tmp_path / "shared" / "checks").glob("*/report.json"))) == 2

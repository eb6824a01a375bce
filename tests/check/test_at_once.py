"""Two checks of the same models at once, each over its own texts (two pass folders under one state dir, sharing its
token cache and the models' files): each ends with the report the same check run alone gives. Real subprocesses,
started together, on tiny generated models (two layers, width 32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
TEXTS = ("the cat sat on the mat\nhello world again and again\n", "one two three four five\nsix seven eight\n")


def _argv(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "resumerge", *map(str, args)]


def test_two_checks_of_the_same_models_at_once_each_end_with_their_own_report(tmp_path: Path) -> None:
    merge, parent = make_model(tmp_path / "m", SPEC, seed=0), make_model(tmp_path / "p", SPEC, seed=1)
    texts = []
    for i, text in enumerate(TEXTS):
        texts.append(tmp_path / f"texts{i}.txt")
        texts[-1].write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def args(i: int, state: Path) -> list[str]:
        return _argv("check", merge, "--parent", parent, "--prompts", texts[i], "--json", "--state-dir", state)

    # Each pauses after each layer's journal is saved: the two passes run side by side.
    paused = {**env, "RESUMERGE_PAUSE_AT": "after_check_layer:0.5"}
    together = [subprocess.Popen(args(i, tmp_path / "shared"), env=paused, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for i in range(2)]
    found = [p.communicate(timeout=300) for p in together]
    for i, (process, (out, err)) in enumerate(zip(together, found)):
        alone = subprocess.run(args(i, tmp_path / f"alone{i}"), env=env, capture_output=True, text=True,
                               timeout=300)
        assert process.returncode == alone.returncode, err[-3000:]
        doc, again = json.loads(out), json.loads(alone.stdout)
        assert Path(doc.pop("chart")).read_bytes() == Path(again.pop("chart")).read_bytes()
        assert doc == again
    assert len(list((tmp_path / "shared" / "checks").glob("*/report.json"))) == 2

"""A check people can gate on (issue 70): its ``--json`` and ``report.json`` are strict JSON that any language's
parser reads, in the broken case too (a non-finite figure is null, what it was beside it).

Tiny generated models (two layers, width 32, a byte-level tokenizer): each check is a second or two."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from resumerge import api
from resumerge.analyses.check.report import BROKEN, CheckReport
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model

pytest.importorskip("transformers")

SPEC = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
TEXTS = "the cat sat on the mat\nhello world again\n"


def _strict(text: str) -> Any:
    """``text`` parsed as Node, Go and serde parse JSON: a bare NaN or Infinity is an error."""
    def refuse(word: str) -> Any:
        raise ValueError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def _nan_copy(source: Path, target: Path) -> Path:
    """A copy of ``source`` whose first layer's down projection is all NaN."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for shard in target.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if "model.layers.0.mlp.down_proj.weight" in tensors:
            tensors["model.layers.0.mlp.down_proj.weight"].fill_(float("nan"))
            save_file(tensors, str(shard), metadata={"format": "pt"})
    return target


def test_json_and_report_json_of_a_broken_merge_are_strict_json(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    base = make_model(tmp_path / "base", SPEC, seed=0)
    parent = make_model(tmp_path / "parent", SPEC, seed=1)
    merge = _nan_copy(base, tmp_path / "merge")
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    state = tmp_path / "state"
    code = main(["check", str(merge), "--base", str(base), "--parent", str(parent), "--prompts", str(texts),
                 "--state-dir", str(state), "--json"])
    printed = capsys.readouterr().out
    doc = _strict(printed)
    assert code == 6 and doc["verdict"] == BROKEN
    # The merge's NaN made its figures not finite: null, with what it was beside it.
    moved = [g for g in doc["static"]["groups"] if g["merge_moved"] is None]
    assert moved and all(g["merge_moved_nonfinite"] == "nan" for g in moved)
    kept = next(state.rglob("report.json"))
    assert _strict(kept.read_text()) == doc
    # Read back (the same check asked again answers from report.json) it is the report that was written.
    again = api.check(merge, base=base, parents=[parent], prompts=texts, settings=api.Settings(state_dir=state))
    assert again.to_json()["static"] == doc["static"] and again.verdict == BROKEN
    assert CheckReport.from_json(doc).to_json()["static"] == doc["static"]
    assert any(g.merge_moved != g.merge_moved for g in again.static.groups)  # NaN again, as the pass found it

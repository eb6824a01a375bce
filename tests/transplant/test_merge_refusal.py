"""A merge config naming models of different tokenizers is refused in one line, exit 2, before anything is written,
and the refusal names the command that gives one of them the other's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support import cli

from transplant.pairs import make_pair


@pytest.mark.parametrize("tokenizer_source", [None, "base", "union"])
def test_models_of_different_tokenizers_are_refused_naming_tokensurgeon(tmp_path: Path,
                                                                         tokenizer_source: str | None) -> None:
    model, donor = make_pair(tmp_path / "pair", model_hidden=48, donor_hidden=48)
    doc: dict[str, object] = {"merge_method": "linear", "base_model": str(model),
                              "models": [{"model": str(model), "parameters": {"weight": 0.5}},
                                         {"model": str(donor), "parameters": {"weight": 0.5}}]}
    if tokenizer_source is not None:
        doc["tokenizer_source"] = tokenizer_source
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(doc))
    ran = cli("run", tmp_path / "merge.yml", tmp_path / "out", "--state-dir", tmp_path / "state")
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "resumerge tokensurgeon MODEL DONOR OUT" in lines[0], ran.stderr
    assert not (tmp_path / "out").exists()

"""Issue 70 on real trained weights (SmolLM2-135M-Instruct, :mod:`realmodel`): a ``tokenizer_source: union`` merge
of the model and a copy with 128 tokens added (49,280 rows against 49,152), checked against its own parents,
ends with a report over the 49,152 tokens they share (before: every layer of every model ran, then a crash in the
heads, exit 1); a text longer than the model's 8,192 positions is refused naming its line, before any layer."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from realmodel import smollm2_folder
from support import write_config

from resumerge import api
from resumerge.errors import UsageError

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ADDED = 128
TEXTS = "The quick brown fox jumps over the lazy dog.\nIn 1492, Columbus sailed across the Atlantic Ocean.\n"


def _extended(base: Path, target: Path) -> Path:
    """``base`` with ``ADDED`` new tokens: in its tokenizer and as rows of its (tied) embeddings."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for item in base.iterdir():
        if item.name not in ("model.safetensors", "tokenizer.json", "config.json"):
            os.link(item, target / item.name)
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    rows = json.loads((base / "config.json").read_text())["vocab_size"]
    tokenizer["added_tokens"] += [{"id": rows + i, "content": f"<|extra_{i}|>", "single_word": False,
                                   "lstrip": False, "rstrip": False, "normalized": False, "special": True}
                                  for i in range(ADDED)]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((base / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "vocab_size": rows + ADDED}))
    tensors = load_file(str(base / "model.safetensors"))
    import torch

    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = torch.cat([embed, embed[:ADDED] * 0.5]).contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_union_merge_checked_against_its_parents_reports_the_shared_tokens(tmp_path: Path) -> None:
    base = smollm2_folder()
    extended = _extended(base, tmp_path / "extended")
    config = write_config(tmp_path / "union.yml", {
        "merge_method": "linear", "tokenizer_source": "union", "dtype": "float32",
        "models": [{"model": str(base), "parameters": {"weight": 0.5}},
                   {"model": str(extended), "parameters": {"weight": 0.5}}]})
    out, state = tmp_path / "out", tmp_path / "state"
    api.run(config, out, settings=api.Settings(state_dir=state))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 49_152 + ADDED
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    report = api.check(out, prompts=texts, settings=api.Settings(state_dir=state))  # its parents from its record
    print("union", report.verdict, report.vocabulary, [(m.role, m.nll, m.kl) for m in report.models])
    assert report.shared_tokens == 49_152
    assert report.vocabulary is not None and "49,280" in report.vocabulary and "by id" in report.vocabulary
    for m in report.models:
        assert m.nll is not None and math.isfinite(m.nll)
        if m.role != "merge":
            assert m.kl is not None and math.isfinite(m.kl) and m.top1 is not None and m.top1 > 0.9


def test_a_text_past_the_context_is_refused_naming_its_line_before_any_layer(tmp_path: Path) -> None:
    base = smollm2_folder()
    texts = tmp_path / "texts.txt"
    texts.write_text("a short one\n" + " ".join(["hello"] * 9_619) + "\n")
    refused = r"line 2 of (--)?prompts .* 9,619 tokens, past the 8,192 .*max_position_embeddings"
    with pytest.raises(UsageError, match=refused):
        api.check(base, parents=[base], prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    assert not list((tmp_path / "state").rglob("*.safetensors"))

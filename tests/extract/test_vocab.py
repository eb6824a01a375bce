"""Vocabularies of different sizes: embeddings and head are saved whole from FT (with --embed-lora too, as
mergekit forces), and the card says so; other shapes must match."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model


def test_bigger_vocabulary_is_saved_whole(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]]) -> None:
    base, _ = pair("llama")
    ft = make_model(tmp_path / "ft72", ModelSpec(layers=2, hidden=32, intermediate=48, vocab=72), seed=3)
    out = tmp_path / "out"
    api.extract_lora(str(ft), str(base), out, lora=api.Lora(max_rank=4, embed_lora=True))
    config = json.loads((out / "adapter_config.json").read_text())
    assert {"embed_tokens", "lm_head"} <= set(config["modules_to_save"])
    assert "embed_tokens" not in config["target_modules"]
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert f.get_slice("base_model.model.model.embed_tokens.weight").get_shape() == [72, 32]
        assert f.get_slice("base_model.model.lm_head.weight").get_shape() == [72, 32]
    assert "the vocabularies differ" in (out / "README.md").read_text()

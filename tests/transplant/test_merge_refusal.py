"""A merge config naming models of different tokenizers is refused in one line, exit 2, before anything is written,
and the refusal names the command that gives one of them the other's tokenizer."""

from __future__ import annotations

import json
import subprocess
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


def _same_size_pair(root: Path) -> tuple[Path, Path]:
    """Two models of one architecture and vocabulary size whose tokenizers are make_model's BPE tokenizer, the
    second's as written (tests edit it)."""
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=1, hidden=32, intermediate=48, vocab=120)
    return make_model(root / "a", spec, seed=1), make_model(root / "b", spec, seed=2)


def _merge(tmp_path: Path, first: Path, second: Path) -> subprocess.CompletedProcess[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    doc = {"merge_method": "linear", "dtype": "float32",
           "models": [{"model": str(first), "parameters": {"weight": 0.5}},
                      {"model": str(second), "parameters": {"weight": 0.5}}]}
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(doc))
    return cli("run", tmp_path / "merge.yml", tmp_path / "out", "--state-dir", tmp_path / "state")


def test_same_size_different_tokenizers_are_refused_and_trivially_different_files_merge(tmp_path: Path) -> None:
    """The same tokens at the same ids merge, whatever else the files say (another chat template, the JSON written
    otherwise, a renamed special token: a chat fine-tune's reserved slot); vocabularies of one size whose ids mean
    other tokens are refused: a merge over them would add rows of unrelated tokens."""
    first, second = _same_size_pair(tmp_path / "models")
    config = json.loads((second / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages }}"
    (second / "tokenizer_config.json").write_text(json.dumps(config))
    data = json.loads((second / "tokenizer.json").read_text())
    data["added_tokens"][2]["content"] = "<|im_end|>"
    (second / "tokenizer.json").write_text(json.dumps(data, indent=None, sort_keys=True))
    ran = _merge(tmp_path / "same", first, second)
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "same" / "out" / "config.json").is_file()

    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens[40], tokens[41] = tokens[41], tokens[40]  # two ordinary tokens swap ids
    data["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    (second / "tokenizer.json").write_text(json.dumps(data))
    ran = _merge(tmp_path / "other", first, second)
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "resumerge tokensurgeon MODEL DONOR OUT" in lines[0], ran.stderr
    assert "token id 40" in lines[0]
    assert not (tmp_path / "other" / "out").exists()


def test_gguf_tokens_are_compared_by_their_strings() -> None:
    """A GGUF's token list gives the same table as the tokenizer.json of its tokens; its control tokens are
    special."""
    from resumerge.merge.vocab.sameness import first_difference, table_of_gguf, table_of_tokenizer_json

    tokens = ["<s>", "a", "b", "ab"]
    gguf = table_of_gguf({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 1, 1, 1]})
    raw = json.dumps({"model": {"type": "BPE", "vocab": {"<unk>": 0, "a": 1, "b": 2, "ab": 3}},
                      "added_tokens": [{"id": 0, "content": "<unk>", "special": True}]}).encode()
    table = table_of_tokenizer_json(raw)
    assert gguf is not None and table is not None
    assert first_difference(gguf, table) is None
    other = table_of_gguf({"tokenizer.ggml.tokens": ["<s>", "a", "ba", "ab"]})
    assert other is not None
    found = first_difference(gguf, other)
    assert found is not None and (found.id, found.first, found.second) == (2, "b", "ba")

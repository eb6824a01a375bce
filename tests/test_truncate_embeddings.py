"""``--unsafe-truncate-embeddings``: a 64-token and a 66-token Llama merge into an output that loads.

mergekit 0.1.5 keeps the common leading rows but leaves config.json's ``vocab_size`` and the donor's tokenizer as
they were (a 66-token donor gives an output transformers refuses). Here ``vocab_size`` follows the rows written,
a donor tokenizer with ids past them is cut, and the log, ``status`` and the model card say what was cut. With
the smaller model as donor the tensors equal mergekit's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ModelFactory
from mergekit_oracle import Mergekit
from support import output_tensors, write_config

from resumerge import api
from resumerge.cli.commands import main


def _doc(a: Path, b: Path, base: Path | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]}
    if base is not None:
        doc["base_model"] = str(base)
    return doc


def _loads_with_ids_in_range(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert max(tokenizer.get_vocab().values()) < model.config.vocab_size == 64
    ids = tokenizer("abab zz Zz", return_tensors="pt").input_ids
    assert int(ids.max()) < 64
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("donor", ["small", "large"])
def test_truncated_output_loads_with_vocab_size_and_tokenizer_cut(
    tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str], donor: str
) -> None:
    small, large = make("small", vocab=64, seed=1), make("large", vocab=66, seed=2)
    cfg = write_config(tmp_path / "c.yml", _doc(small, large, small if donor == "small" else large))
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["run", str(cfg), str(out), "--state-dir", str(state), "--quiet"]) == 2  # refused by default
    assert "vocabularies differ" in capsys.readouterr().err
    assert main(["run", str(cfg), str(out), "--state-dir", str(state), "--unsafe-truncate-embeddings"]) == 0
    assert "UNSAFE vocabulary truncation of lm_head.weight" in capsys.readouterr().err  # the log
    got, a, b = output_tensors(out), output_tensors(small), output_tensors(large)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(got[name], 0.3 * a[name] + 0.7 * b[name][:64], rtol=1e-6, atol=1e-7)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 64
    cut = json.loads((out / "tokenizer.json").read_text())
    assert max(cut["model"]["vocab"].values()) == 63
    if donor == "small":
        assert (out / "tokenizer.json").read_bytes() == (small / "tokenizer.json").read_bytes()
    _loads_with_ids_in_range(out)
    assert main(["status", str(out), "--state-dir", str(state)]) == 0
    assert "kept the first 64" in capsys.readouterr().out
    assert "## Notes" in (out / "README.md").read_text()


def test_a_special_token_past_the_kept_rows_is_refused(tmp_path: Path, make: ModelFactory,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    small, large = make("small", vocab=64, seed=1), make("large", vocab=66, seed=2)
    config = json.loads((large / "tokenizer_config.json").read_text())
    vocab = json.loads((large / "tokenizer.json").read_text())["model"]["vocab"]
    config["pad_token"] = next(tok for tok, i in vocab.items() if i == 65)
    (large / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = write_config(tmp_path / "c.yml", _doc(small, large, large))
    assert main(["run", str(cfg), str(tmp_path / "out"), "--unsafe-truncate-embeddings", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "base_model" in err and "pad_token" in err and not (tmp_path / "out").exists()


@pytest.mark.oracle
def test_equal_to_mergekit_with_the_smaller_model_as_base(tmp_path: Path, make: ModelFactory,
                                                          mergekit: Mergekit) -> None:
    small, large = make("small", vocab=64, seed=1), make("large", vocab=66, seed=2)
    cfg = write_config(tmp_path / "c.yml", _doc(small, large, small))
    ours = api.run(cfg, tmp_path / "ours", settings=api.Settings(state_dir=tmp_path / "state",
                                                                 merging=api.Merging(unsafe_truncate_embeddings=True))).out_dir
    done = mergekit.run(cfg, tmp_path / "theirs", "--unsafe-truncate-embeddings", "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    mine, theirs = output_tensors(Path(ours)), output_tensors(tmp_path / "theirs")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)

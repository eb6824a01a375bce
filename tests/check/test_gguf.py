"""``resumerge check`` of GGUF models (issue 58): a GGUF file as MODEL, ``--base`` or ``--parent``, its tensors decoded
by the GGUF codec and its config.json and tokenizer rebuilt from its metadata into a folder under the state dir
(nothing written beside the file); a resumerge GGUF output checked against the base and parents its record names.

The real SmolLM2-135M-Instruct Q4_1 GGUF checked against the float32 folder of its decoded tensors
(:mod:`realmodel`): the streamed forward of the GGUF gives transformers' loss of the decoded weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from realmodel import smollm2_folder, smollm2_gguf
from support import write_config

from resumerge import api
from resumerge.analyses.check.report import BROKEN, NO_EFFECT, WORKS
from resumerge.cli.commands import main

pytest.importorskip("transformers")

TEXTS = "The quick brown fox jumps over the lazy dog.\nIn 1492, Columbus sailed across the Atlantic Ocean.\n"
TINY_TEXTS = "the cat sat on the mat.\n12 plus 30 is 42.\n"  # in the tiny GGUFs' vocabulary


def _loss(folder: Path, texts: Path) -> float:
    """transformers' NLL of the model in ``folder`` over the lines of ``texts``, per predicted token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for line in texts.read_text().splitlines():
            ids = torch.tensor([tokenizer(line)["input_ids"]])
            total += float(model(ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


@pytest.mark.slow
def test_the_real_gguf_checked_against_its_decoded_tensors_works_with_transformers_nll(tmp_path: Path) -> None:
    gguf, folder = smollm2_gguf(), smollm2_folder()
    beside = sorted(p.name for p in gguf.parent.iterdir())
    texts = tmp_path / "texts.txt"
    texts.write_text(TEXTS)
    report = api.check(gguf, base=folder, prompts=texts, settings=api.Settings(state_dir=tmp_path / "state"))
    # The file and its decoding hold the same weights: a model identical to its base is "no effect" (exit 5).
    assert report.verdict == NO_EFFECT and report.exit_code == 5, report.reasons
    assert [(m.role, m.path) for m in report.models] == [("merge", str(gguf)), ("base", str(folder))]
    assert report.to_json()["models"][0]["path"] == str(gguf)
    merge, base = report.models
    # The same weights (the folder is transformers' decoding of the file): the same logits (KL 0, the same top
    # token everywhere) and transformers' loss of those weights, to float32 rounding.
    assert merge.nll is not None and merge.nll == pytest.approx(_loss(folder, texts), abs=1e-4)
    assert base.nll == pytest.approx(merge.nll, abs=1e-4) and (base.kl or 0.0) < 1e-6 and base.top1 == 1.0
    # The static pass read every tensor of both through their codecs: the same shapes, no NaN, nothing moved.
    assert not report.static.nonfinite and not report.static.shape_problems
    assert report.static.parameters["merge"] == report.static.parameters["base"] == 134_515_008
    assert all(g.merge_moved == 0.0 for g in report.static.groups)
    assert sorted(p.name for p in gguf.parent.iterdir()) == beside  # the rebuilt files are in the state dir
    (made,) = (tmp_path / "state" / "gguf").iterdir()
    assert {"config.json", "tokenizer.json", gguf.name} <= {p.name for p in made.iterdir()}


def test_a_gguf_output_is_checked_against_the_gguf_parents_its_record_names(tmp_path: Path) -> None:
    parents = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for seed, path in enumerate(parents):
        write_gguf(path, "qwen3", to_gguf("qwen3", hf_tensors("qwen3", seed)), Q.F32, split_max_tensors=9 * seed)
    parents[1] = tmp_path / "b-00001-of-00003.gguf"  # a split set, named by its first file
    assert parents[1].is_file()
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(p), "parameters": {"weight": w}} for p, w in zip(parents, (0.3, 0.7))]})
    out, state = tmp_path / "out", tmp_path / "state"
    # run --check checks the GGUF output it wrote (built-in texts), and exits with the verdict's code
    assert main(["run", str(config), str(out), "--out-type", "gguf", "--gguf-type", "f16", "--check",
                 "--state-dir", str(state), "--quiet"]) == 0
    texts = tmp_path / "texts.txt"
    texts.write_text(TINY_TEXTS)
    report = api.check(out, prompts=texts, settings=api.Settings(state_dir=state))  # the parents from its record
    assert [(m.role, m.path) for m in report.models] == [("merge", str(out)), ("parent", str(parents[0])),
                                                         ("parent", str(parents[1]))]
    assert report.verdict == WORKS, report.reasons
    assert not report.static.nonfinite and not report.static.shape_problems
    # An F16 encoding of the 0.3/0.7 blend: nearer the parent of weight 0.7.
    kl = {m.path: m.kl for m in report.models[1:]}
    assert kl[str(parents[1])] < kl[str(parents[0])]
    assert "resumerge check" in (out / "README.md").read_text() and report.card is not None
    assert json.loads(json.dumps(report.to_json()))["models"][0]["path"] == str(out)


def test_a_gguf_holding_nan_is_broken_in_the_static_pass(tmp_path: Path) -> None:
    values = hf_tensors("llama", 1)
    values["model.layers.1.mlp.up_proj.weight"][3, 7] = float("nan")
    # Two files of one header (the same name, type and shapes, in folders of their own): transformers rebuilds the
    # tokenizer of the first, and the second's is found kept (resumerge.inputs.gguf.tokenizer) rather than rebuilt
    # again (a fresh interpreter's import of transformers, ~5 CPU s).
    base, broken = tmp_path / "base" / "model.gguf", tmp_path / "nan" / "model.gguf"
    base.parent.mkdir()
    broken.parent.mkdir()
    write_gguf(base, "llama", to_gguf("llama", hf_tensors("llama", 0)), Q.F16)
    write_gguf(broken, "llama", to_gguf("llama", values), Q.F16)
    texts = tmp_path / "texts.txt"
    texts.write_text(TINY_TEXTS)
    report = api.check(broken, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "s"))
    assert report.verdict == BROKEN and report.static.nonfinite == ("model.layers.1.mlp.up_proj.weight",)
    assert report.models[0].path == str(broken)

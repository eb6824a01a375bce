"""``check`` on the newest families (tests/newest_families.py): its NLL is transformers' unpadded whole-model NLL.

Before this, LFM2 and LFM2-MoE were checked without their final norm (``model.embedding_norm``, missing from a list
of names, as Phi-2's ``model.final_layernorm`` was), Nemotron-H's forward failed on the layers' stand-ins (it reads
each layer's ``block_type``) and a base saved with a layer count was refused beside a merge without one ("has None
layers"), Gemma 4 sharing keys and values failed in its forward's shortcut, DeepSeek-V3.2's padded batches gave
other figures (its indexer picks other keys in a padded batch) and GLM-5 ended in an internal error. Now the final
norm is the module the base model's forward calls after its layers, a family whose first layer gives a sequence in
a padded batch other values than alone runs one sequence at a time, and GLM-5, whose layers hand their top-k
indices to the next, is refused in one line (exit 2)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from newest_families import make_newest_model

from resumerge.analyses.check.models import Checked
from resumerge.analyses.check.passes import forward_pass, streams_of
from resumerge.cli.commands import main
from resumerge.cli.modelgen import write_tokenizer
from resumerge.config.modelref import ModelRef
from resumerge.forward.batches import padded
from resumerge.forward.placement import runs_batched
from resumerge.forward.stream import final_norm_name
from resumerge.inputs.model import open_model
from resumerge.torch_import import torch

pytest.importorskip("transformers")

_IDS = torch.Generator().manual_seed(0)
# lengths that put padding beside real positions a top-k indexer of 4 keys chooses among (30 beside 17)
TOKENS = [torch.randint(1, 128, (n,), generator=_IDS).tolist() for n in (30, 17, 9, 5)]
# family -> (the final norm's attribute, whether a padded batch runs as it would alone)
FAMILIES = {"lfm2": ("embedding_norm", True), "lfm2_moe": ("embedding_norm", True), "nemotron_h": ("norm_f", True),
            "deepseek_v32": ("norm", False), "gemma4": ("norm", True), "gemma4_shared": ("norm", True),
            "phi": ("final_layernorm", True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("newest_check")
    yield {family: make_newest_model(root / family, family, 3) for family in (*FAMILIES, "glm5")}


def _checked(directory: Path) -> Checked:
    return Checked("merge", str(directory), None, open_model(ModelRef(str(directory)), directory=directory))


def _unpadded_nll(directory: Path, tokens: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():  # every hidden state asked for: Gemma 4's key-sharing shortcut fails otherwise (5.24)
        losses = [float(reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]),
                                  output_hidden_states=True).loss) * (len(ids) - 1) for ids in tokens]
    return sum(losses) / sum(len(ids) - 1 for ids in tokens)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_check_nll_is_transformers_unpadded_nll(family: str, models: dict[str, Path], tmp_path: Path) -> None:
    norm, batched = FAMILIES[family]
    model = _checked(models[family])
    streams = streams_of([model])
    try:
        assert final_norm_name(streams[0].inner, streams[0].layers_list) == norm
        with torch.no_grad():
            batch = padded(TOKENS)
            assert runs_batched(streams[0], streams[0].inputs([batch]), batches=[batch]) is batched
        figures = forward_pass([model], streams, TOKENS, tmp_path / "journal")
    finally:
        for stream in streams:
            stream.close()
    assert figures.nll[0] == pytest.approx(_unpadded_nll(models[family], TOKENS), abs=1e-4)


def _with_tokenizer(source: Path, target: Path) -> Path:
    write_tokenizer(shutil.copytree(source, target), 128)
    return target


def test_glm5_whose_layers_hand_on_their_top_k_indices_is_refused_in_one_line(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    merge = _with_tokenizer(models["glm5"], tmp_path / "glm5")
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\n")
    assert main(["check", str(merge), "--prompts", str(texts), "--state-dir", str(tmp_path / "s"), "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "decoder layer 1 is called with what layer 0 returns" in lines[0], lines


def test_nemotron_h_without_a_layer_count_is_checked_against_a_base_with_one(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import json

    merge = _with_tokenizer(models["nemotron_h"], tmp_path / "merge")
    base = _with_tokenizer(models["nemotron_h"], tmp_path / "base")
    doc = json.loads((base / "config.json").read_text())
    assert "num_hidden_layers" not in doc  # as transformers 5.24 saves it
    del doc["layers_block_type"]
    (base / "config.json").write_text(json.dumps({**doc, "hybrid_override_pattern": "ME*-", "num_hidden_layers": 4}))
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world\n")
    code = main(["check", str(merge), "--base", str(base), "--prompts", str(texts), "--state-dir", str(tmp_path / "s"),
                 "--quiet"])
    assert code == 0  # compared layer by layer with its base (before: refused, "has 4 layers ... the merge None")

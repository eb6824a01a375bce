"""``check`` on the newest families (tests/newest_families.py): its NLL is transformers' unpadded whole-model NLL.

Before this, LFM2 and LFM2-MoE were checked without their final norm (``model.embedding_norm``, missing from a list
of names, as Phi-2's ``model.final_layernorm`` was), Nemotron-H's forward failed on the layers' stand-ins (it reads
each layer's ``block_type``) and a base saved with a layer count was refused beside a merge without one ("has None
layers"), Gemma 4 sharing keys and values failed in its forward's shortcut, DeepSeek-V3.2's padded batches gave
other figures (its indexer picks other keys in a padded batch) and GLM-5 ended in an internal error, then was
refused in one line. Now the final norm is the module the base model's forward calls after its layers, a family
whose first layer gives a sequence in a padded batch other values than alone runs one sequence at a time, and
GLM-5's layers hand their top-k indices to the next (its "shared" indexers take them) as its forward does, journaled
beside the hidden states: a check killed after a layer resumes with the same figures."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from newest_families import make_newest_model
from safetensors import safe_open
from support import cli, cli_here

from resumerge import api
from resumerge.analyses.check.models import Checked
from resumerge.cli.commands import main
from resumerge.cli.modelgen import write_tokenizer
from resumerge.config.modelref import ModelRef
from resumerge.forward.compared.passes import forward_pass, streams_of
from resumerge.forward.engine.layerlists import innermost
from resumerge.forward.engine.tail import final_names
from resumerge.forward.job.placement import runs_batched
from resumerge.forward.text.batches import padded
from resumerge.inputs.model import open_model
from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")

_IDS = torch.Generator().manual_seed(0)
# lengths that put padding beside real positions a top-k indexer of 4 keys chooses among (30 beside 17)
TOKENS = [torch.randint(1, 128, (n,), generator=_IDS).tolist() for n in (30, 17, 9, 5)]
# family -> (the final norm's attribute, whether a padded batch runs as it would alone)
FAMILIES = {"lfm2": ("embedding_norm", True), "lfm2_moe": ("embedding_norm", True), "nemotron_h": ("norm_f", True),
            "deepseek_v32": ("norm", False), "gemma4": ("norm", True), "gemma4_shared": ("norm", True),
            "phi": ("final_layernorm", True), "glm5": ("norm", False)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("newest_check")
    yield {family: make_newest_model(root / family, family, 3) for family in FAMILIES}


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
        assert final_names(streams[0].inner, innermost(streams[0].stack)) == (norm,)
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


def test_a_killed_check_of_glm5_resumes_with_the_top_k_indices_its_layers_handed_on(
    models: dict[str, Path], tmp_path: Path
) -> None:
    merge = _with_tokenizer(models["glm5"], tmp_path / "glm5")
    parent = _with_tokenizer(make_newest_model(tmp_path / "other", "glm5", 4), tmp_path / "parent")
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world, and a longer line of words than the others\n")
    argv = ["check", merge, "--parent", parent, "--prompts", texts, "--json", "--state-dir", tmp_path / "killed"]
    # killed after layer 2, whose top-k indices layer 3 (a "shared" one) takes: resumed from the journal's file
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_check_layer:3"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    journal = list((tmp_path / "killed").rglob("layer-*.safetensors"))
    assert [p.name for p in journal] == ["layer-00002.safetensors"]
    with safe_open(str(journal[0]), "pt") as opened:  # layer 2's top-k indices, which layer 3 takes, per model
        carried = [n.split(".") for n in opened.keys() if n.startswith("carried.")]  # noqa: SIM118
    assert {m for _, m, _, _, _ in carried} == {"0", "1"} and {(i, q) for *_, i, q in carried} == {("2", "0")}
    resumed = cli_here(*argv)  # unkilled: the CLI's main in this process, reading the killed one's journal
    whole = api.check(merge, parents=[parent], prompts=texts, settings=api.Settings(state_dir=tmp_path / "whole"))
    assert resumed.returncode == whole.exit_code, resumed.stderr[-2000:]
    doc, same = json.loads(resumed.stdout), json.loads(json.dumps(whole.to_json()))
    doc.pop("chart"), same.pop("chart")
    assert doc == same


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
    # compared layer by layer with its base (before: refused, "has 4 layers ... the merge None"); the same weights
    # as its base: no effect (exit 5)
    assert code == 5

"""What a base model's forward computes between its decoder layers from earlier layers' outputs, and hands a later
layer or reads after the last one (resumerge.forward.engine.handed's derived values): Inkling 2's block states, the
hidden states entering each block-boundary layer stacked by its forward between layer calls, which every later layer and
its final block-attention residual take. Before, the layer-by-layer pass recorded them from its stand-ins (every
layer saw the embeddings there) and its tail stacked zeros for the embeddings: ``check``'s NLL was 7.7e-3 off
transformers' own (tests/test_census.py's inkling2_text row). Now each value the forward derives from earlier
layers' outputs is computed again from the pass's, journaled with each layer: a killed check resumes with the same
figures. A text holding a token past the head's rows (Inkling 2's head holds fewer than its embedding) is refused in
one line, where it crashed in torch's gather."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from census import make_census_model
from safetensors import safe_open
from support import cli, cli_here

from resumerge import api
from resumerge.cli.modelgen import write_tokenizer
from resumerge.errors import ModelInputError
from resumerge.forward.compared.heads import nll_sum
from resumerge.machine.torch_import import torch

pytest.importorskip("transformers")


def test_a_token_past_the_heads_rows_is_refused_in_one_line() -> None:
    found = torch.zeros(3, 500).log_softmax(-1)
    with pytest.raises(ModelInputError) as refused:
        nll_sum(found, torch.tensor([5, 507, 2]), 0.0)
    assert str(refused.value).splitlines() == ["a text holds token 507, past the 500 rows of the model's head (it "
                                               "scores tokens 0 to 499)"]


@pytest.mark.slow
@pytest.mark.parametrize("kill", [3, 4])  # after layer 2 (layer 1's output: layer 3's block states), after the last
def test_a_killed_check_of_inkling2_resumes_with_the_block_states_its_forward_derived(
    tmp_path: Path, kill: int
) -> None:
    # (tests/census.py's Inkling 2: blocks of two layers, so layer 3 and the tail take layer 1's output)
    merge = make_census_model(tmp_path / "merge", "inkling2_text", 1)
    write_tokenizer(merge, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world, and a longer line of words than the others\n")
    argv = ["check", merge, "--prompts", texts, "--json", "--state-dir", tmp_path / "killed"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": f"after_check_layer:{kill}"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (journal,) = list((tmp_path / "killed").rglob("layer-*.safetensors"))
    with safe_open(str(journal), "pt") as opened:  # layer 1's output, which layer 3 and the tail take; the last's
        carried = {tuple(n.split(".")[3:]) for n in opened.keys() if n.startswith("carried.")}  # noqa: SIM118
    assert carried == ({("1", "0")} if kill == 3 else {("1", "0"), ("3", "0")})
    resumed = cli_here(*argv)  # unkilled: the CLI's main in this process, reading the killed one's journal
    whole = api.check(merge, prompts=texts, settings=api.Settings(state_dir=tmp_path / "whole"))
    assert resumed.returncode == whole.exit_code, resumed.stderr[-2000:]
    doc, same = json.loads(resumed.stdout), json.loads(json.dumps(whole.to_json()))
    doc.pop("chart"), same.pop("chart")
    assert doc == same

"""A forward whose layers return an object it reads by attribute, each a stream of its own (Reformer's reversible
layers return ``attn_output`` and ``hidden_states``; the next layer takes both, and the forward after the last puts
the two side by side before its LayerNorm, then cuts off the positions it padded to a multiple of its chunk length):
``check``'s capture stands an object for each layer's output whose every attribute read is traced
(resumerge.forward.handed.Reads), the one the next call takes as its hidden states the pass's hidden output, the
others handed on as any layer's extra outputs and journaled while a later call or the last hidden state reads them.
Before, ``check`` refused Reformer in one line ("reformer runs its layers as a reversible pair of streams")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from census import make_census_model
from safetensors import safe_open
from support import cli, cli_here

from resumerge import api
from resumerge.cli.modelgen import write_tokenizer

pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.parametrize("kill", [2, 4])  # between two layers, and after the last (the tail reads both streams)
def test_a_killed_check_of_reformer_resumes_with_its_second_stream(tmp_path: Path, kill: int) -> None:
    merge, base = (make_census_model(tmp_path / role, "reformer", seed) for role, seed in (("merge", 1), ("base", 2)))
    write_tokenizer(merge, 128)
    write_tokenizer(base, 128)
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world, and a longer line of words than the others\n")
    argv = ["check", merge, "--base", base, "--prompts", texts, "--json", "--state-dir", tmp_path / "killed"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": f"after_check_layer:{kill}"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (journal,) = list((tmp_path / "killed").rglob("layer-*.safetensors"))
    with safe_open(str(journal), "pt") as opened:  # each batch's attention stream, which the next call takes
        carried = [n for n in opened.keys() if n.startswith("carried.")]  # noqa: SIM118
    assert carried, "the second stream was not journaled"
    resumed = cli_here(*argv)  # unkilled: the CLI's main in this process, reading the killed one's journal
    whole = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "whole"))
    assert resumed.returncode == whole.exit_code, resumed.stderr[-2000:]
    doc, same = json.loads(resumed.stdout), json.loads(json.dumps(whole.to_json()))
    doc.pop("chart"), same.pop("chart")
    assert doc == same and len(doc["models"][1]["drift"]) == 4

"""A forward that calls some of its decoder layers several times (Dory loops its middle layers, an Inkling 2 Loop
model its core layers): ``check``'s pass runs the forward's layer calls, a layer called twice two steps
(resumerge.forward.engine.calls), each journaled; what the forward gives a call that is not the previous call's output
(a loop's start: Dory's normed output plus its normed input section's) is computed again from the pass's outputs
(resumerge.forward.engine.handed). Before, ``check`` refused them in one line ("dory loops its middle layers"). A stack
of slices of such a model stays refused (a slice of a loop is no model of its family); its own stack is not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from census import make_census_model
from safetensors import safe_open
from support import cli, cli_here

from resumerge import api
from resumerge.analyses.check.models import Checked
from resumerge.cli.modelgen import write_tokenizer
from resumerge.config.modelref import ModelRef
from resumerge.forward.compared.passes import streams_of
from resumerge.inputs.model import open_model
from resumerge.merge.plan.architecture import unsliceable

pytest.importorskip("transformers")


def test_an_inkling2_loop_model_whose_loop_runs_is_no_stack_a_slice_may_cut() -> None:
    looping = {"model_type": "inkling2_loop_text", "num_hidden_layers": 24, "loop_layer_index_start": 6,
               "loop_layer_index_end": 18, "loop_num_passes": 3}
    assert unsliceable(looping) == "loops its layers 6 to 17 (3 passes: loop_num_passes)"
    assert unsliceable({**looping, "loop_num_passes": 1}) is None  # its loop off: a stack
    assert unsliceable({**looping, "num_hidden_layers": 4}) is None  # no looped layer among its four
    assert unsliceable({"model_type": "inkling2_loop_text", "num_hidden_layers": 40,  # as its checkpoints say it
                        "loop_config": {"core_start": 8, "core_end": 24, "num_passes": 2}}) is not None


@pytest.mark.slow
# Dory after call 2 (layer 1's first, before its second) and after call 4 (layer 1's second, between layer 2's two);
# HRM after call 14 (its high-level stack's second layer's first call, of two; its low-level stack's layers run 6 times)
@pytest.mark.parametrize(("family", "kill"), [("dory", 2), ("dory", 4), ("hrm_text", 14)])
def test_a_killed_check_of_a_looped_forward_resumes_between_two_calls_of_one_layer(
    tmp_path: Path, family: str, kill: int
) -> None:
    # (tests/census.py's Dory: one input layer, two looped twice, one output layer; its HRM: two stacks of four
    # layers, each high-level cycle three low-level runs then one high-level run, two cycles)
    merge, base = (make_census_model(tmp_path / role, family, seed) for role, seed in (("merge", 1), ("base", 2)))
    write_tokenizer(merge, 128)
    write_tokenizer(base, 128)
    model = Checked("merge", str(merge), None, open_model(ModelRef(str(merge)), directory=merge))
    (stream,) = streams_of([model])
    with stream:  # each call a step
        assert stream.order == ([0, 1, 2, 1, 2, 3] if family == "dory" else
                                [*[0, 1, 2, 3] * 3, 4, 5, 6, 7, *[0, 1, 2, 3] * 3, 4, 5, 6, 7])
    carried, doc, same = killed_and_resumed(tmp_path, merge, base, kill)
    if family == "dory":  # (the input section's output, which the next loop's start takes; after the last: none)
        assert carried == ({("0", "0")} if kill == 2 else set())
    assert doc == same and len(doc["models"][1]["drift"]) == len(stream.order)  # a figure per call


def killed_and_resumed(tmp_path: Path, merge: Path, base: Path, kill: int
                       ) -> tuple[set[tuple[str, ...]], dict[str, Any], dict[str, Any]]:
    """``check`` of ``merge`` against ``base`` killed after layer step ``kill``: what its journal carries (each
    as (layer, output)), then its report resumed and the report of a whole check (their charts apart)."""
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat\nhello world, and a longer line of words than the others\n")
    argv = ["check", merge, "--base", base, "--prompts", texts, "--json", "--state-dir", tmp_path / "killed"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": f"after_check_layer:{kill}"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    (journal,) = list((tmp_path / "killed").rglob("layer-*.safetensors"))
    with safe_open(str(journal), "pt") as opened:
        carried = {tuple(n.split(".")[3:]) for n in opened.keys() if n.startswith("carried.")}  # noqa: SIM118
    resumed = cli_here(*argv)  # unkilled: the CLI's main in this process, reading the killed one's journal
    whole = api.check(merge, base=base, prompts=texts, settings=api.Settings(state_dir=tmp_path / "whole"))
    assert resumed.returncode == whole.exit_code, resumed.stderr[-2000:]
    doc, same = json.loads(resumed.stdout), json.loads(json.dumps(whole.to_json()))
    doc.pop("chart"), same.pop("chart")
    return carried, doc, same

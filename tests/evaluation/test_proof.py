"""An evaluation's models proved by the bytes its passes read (:class:`resumerge.forward.job.proof.JournalProof`): a
pass resumed after the model was edited in a layer its journal holds is refused (exit 4, the file and the layer
named); an edit in a layer the pass had not read yet is reported and read as it is now; a finished pass of bytes the
model no longer holds is run again.

The model (3 layers, width 128: over 1 MiB a file) is edited outside the 16 blocks its identity samples, so that
the pass's key (its folder) stays the same and only the proof can see it. Real processes, killed for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from proofedits import edit_unsampled

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model, write_tokenizer
from tests.evaluation.evaltasks import CHAT, write_tasks
from tests.support import cli, cli_here

pytest.importorskip("lm_eval")

SPEC = ModelSpec(layers=3, hidden=128, intermediate=256, vocab=64, shard_bytes=1 << 30)


def _model(directory: Path) -> Path:
    model = make_model(directory, SPEC, seed=0)
    write_tokenizer(model, SPEC.vocab, chat_template=CHAT)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 24
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def _eval(model: Path, tasks: Path, state: Path, kill: str | None = None) -> tuple[int, str, dict[str, object]]:
    """The evaluation through the CLI: killed at ``kill`` in a process of its own (a real SIGKILL), or, unkilled,
    through the CLI's main in this process (support.cli_here: the same parsing, lines and exit codes)."""
    args = ("eval", model, "--tasks", "tiny_ppl", "--include-path", tasks, "--state-dir", state, "--json")
    done = cli(*args, env={"RESUMERGE_KILL_AT": kill}, timeout=300) if kill is not None else cli_here(*args)
    return done.returncode, done.stderr, json.loads(done.stdout)["results"] if done.returncode == 0 else {}


@pytest.mark.slow
def test_a_resumed_pass_refuses_an_edit_in_a_journaled_layer_and_reads_a_later_one_as_it_is(tmp_path: Path) -> None:
    model, tasks, state = _model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    code, err, _ = _eval(model, tasks, state, kill="after_eval_layer:2")  # layers 1 and 2 of 3 journaled
    assert code == -9, err[-2000:]
    held = (model / "model.safetensors").read_bytes()
    file = edit_unsampled(model, "model.layers.0.self_attn.q_proj.weight")
    code, err, _ = _eval(model, tasks, state)
    assert code == 4, err[-2000:]
    assert str(file) in err and "decoder layer 0" in err and "Traceback" not in err
    with open(file, "r+b") as f:  # put back in place: the bytes the journal was computed from
        f.write(held)
    edit_unsampled(model, "model.layers.2.mlp.up_proj.weight")  # a layer the pass has not read yet
    code, err, resumed = _eval(model, tasks, state)
    assert code == 0, err[-2000:]
    assert f"eval: inputs: {file} changed in ranges this pass had not read yet: read as they are now" in err
    assert "layer 1/3" not in err.split("loglikelihood_rolling", 1)[1]  # resumed at layer 3, not run again
    whole = api.evaluate(model, ["tiny_ppl"], api.Settings(state_dir=tmp_path / "whole"),
                         harness=api.Harness(include_path=tasks))
    assert resumed == whole.to_json()["results"]  # the results of the file as it is now


def test_a_finished_pass_of_bytes_no_longer_held_runs_again(tmp_path: Path) -> None:
    model, tasks, state = _model(tmp_path / "model"), write_tasks(tmp_path), tmp_path / "state"
    first = api.evaluate(model, ["tiny_ppl"], api.Settings(state_dir=state), harness=api.Harness(include_path=tasks))
    assert first.proof is None and len(list(state.glob("evals/*/inputs.json"))) == 1
    again = api.evaluate(model, ["tiny_ppl"], api.Settings(state_dir=state),
                         harness=api.Harness(include_path=tasks),
                         progress=lambda step: pytest.fail(f"a finished pass ran again: {step}"))
    assert again.to_json()["results"] == first.to_json()["results"] and again.proof is None
    file = edit_unsampled(model, "model.layers.1.mlp.down_proj.weight")
    edited = api.evaluate(model, ["tiny_ppl"], api.Settings(state_dir=state), harness=api.Harness(include_path=tasks))
    assert edited.proof == f"{file} changed since this evaluation of {model} ran (in a range it reads): run again"
    ppl = "word_perplexity,none"
    assert edited.results["results"]["tiny_ppl"][ppl] != first.results["results"]["tiny_ppl"][ppl]

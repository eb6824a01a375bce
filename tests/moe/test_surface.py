"""What the user sees of a MoE merge: mergekit-moe's warnings in the log, ``status`` and the model card; the
missing optional dependency of the prompt gate modes as one exit-2 line; mergekit-moe's flags accepted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resumerge import api
from resumerge.config.locations import state_root
from resumerge.errors import UsageError, exit_code_for
from tests.moe.models import llamas, write
from tests.support import cli

DEGENERATE = "layers 0 and 1 have degenerate routing parameters - your prompts may be too similar."
POWER = "Your model has 3 experts, which is not a power of two. The model will not be usable in llama.cpp."


def _config(tmp_path: Path) -> Path:
    m = llamas(tmp_path)
    return write(tmp_path / "moe.yml", {
        "base_model": str(m[0]), "gate_mode": "cheap_embed",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab"]},
                    {"source_model": str(m[2]), "positive_prompts": ["ab ab"]},
                    {"source_model": str(m[0]), "positive_prompts": ["ab cd"]}]})


def test_warnings_reach_status_and_the_model_card(tmp_path: Path) -> None:
    out = tmp_path / "out"
    outcome = api.run(_config(tmp_path), out, state_dir=tmp_path / "state")
    notes = api.status(out, state_dir=tmp_path / "state").plan_notes
    assert POWER in notes and any(n.startswith(DEGENERATE) for n in notes)
    assert outcome.plan.notes == notes
    card = (out / "README.md").read_text()
    assert f"- {POWER}" in card and DEGENERATE in card and "Mixture of Experts" in card


def test_prompt_modes_without_transformers_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "no-transformers" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('transformers is not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}
    done = cli("run", _config(tmp_path), tmp_path / "out", "--load-in-4bit", env=env)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("note: --load-in-4bit is not needed by resumerge")
    assert len(lines) == 2 and lines[1].startswith("error: gate_mode: gate_mode cheap_embed needs transformers")
    assert "pip install" in lines[1]
    assert not (tmp_path / "out").exists()


def test_plan_merge_plans_without_running_anything(tmp_path: Path) -> None:
    m = llamas(tmp_path)
    config = write(tmp_path / "hidden.yml", {
        "base_model": str(m[0]), "gate_mode": "hidden",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab"]},
                    {"source_model": str(m[2]), "positive_prompts": ["cd"]}]})
    plan = api.plan_merge(config, random_seed=5)
    assert plan.method == "moe" and len(plan.tensors) == 21 and plan.out_config["num_local_experts"] == 2
    assert dict(plan.tensors["model.layers.1.mlp.gate.weight"].params)["values"] is None
    # plan's estimate counts the pass (its process started once to see what it holds), without running it
    estimate = api.estimate(config, tmp_path / "out", probe_size=0)
    assert estimate.time.prepass_seconds > 0 and estimate.memory.prepass_bytes > estimate.memory.baseline_bytes
    assert estimate.memory.peak_bytes >= estimate.memory.prepass_bytes
    assert not (state_root() / "moe-routers").exists()  # the forward pass did not run



def test_the_passes_refusal_is_the_runs_one_line(tmp_path: Path) -> None:
    # the forward pass runs in a process of its own (tests/moe/test_resume.py shows transformers never enters the
    # run's): its refusal, its memory share too small for a layer, comes back as the run's exit-2 error
    m = llamas(tmp_path)
    config = write(tmp_path / "hidden.yml", {
        "base_model": str(m[0]), "gate_mode": "hidden",
        "experts": [{"source_model": str(m[1]), "positive_prompts": ["ab"]},
                    {"source_model": str(m[2]), "positive_prompts": ["cd"]}]})
    with pytest.raises(UsageError) as refused:
        api.run(config, tmp_path / "small", state_dir=tmp_path / "state", max_memory="200MB")
    assert exit_code_for(refused.value) == 2 and "\n" not in refused.value.one_line()
    assert refused.value.message.startswith("the prompt forward pass needs")
    assert "--max-memory" in refused.value.one_line() and not (tmp_path / "small").exists()

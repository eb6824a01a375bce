"""Messages that contradicted each other or the truth (issue 60, items 10 and 12), each held to its line: an
unreachable hub OUT before anything started, a model named by its weights file, ``plan``'s memory line against its
verdict, and what an estimate or a plan shows in a notebook."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from support import cli, linear_config, write_config

from resumerge import api
from resumerge.analyses.estimate.costs import MemoryEstimate, memory_line
from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import EXIT_INVALID
from resumerge.machine.memory.sizes import format_size

MB = 1_000_000


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("messages")
    return make_model(root / "a", ModelSpec(), seed=1), make_model(root / "b", ModelSpec(), seed=2)


@pytest.mark.parametrize("kind", ["merge", "recipe"])
def test_an_unreachable_hub_out_before_anything_started_is_exit_2(
        tmp_path: Path, models: tuple[Path, Path], kind: str) -> None:
    """An hf:// OUT with no network said "run resumerge resume … when the hub answers" (exit 3) though nothing was
    started, where an unreachable hub input rightly says "run the same command again" (exit 2)."""
    home = tmp_path / "hf"
    env = {"HF_ENDPOINT": "http://127.0.0.1:9",  # the discard port: connection refused
           "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN": "hf_test",
           "HF_HUB_OFFLINE": "0"}
    cfg = write_config(tmp_path / "c.yml", linear_config(*models))
    if kind == "recipe":
        final = {"merge_method": "linear", "models": [{"model": "mid", "parameters": {"weight": 0.5}},
                                                      {"model": str(models[1]), "parameters": {"weight": 0.5}}]}
        cfg.write_text(yaml.safe_dump_all([{"name": "mid", **yaml.safe_load(cfg.read_text())}, final]))
    done = cli("run", cfg, "hf://someone/merged", "--state-dir", tmp_path / "state", "--quiet", env=env)
    assert done.returncode == EXIT_INVALID, done.stderr
    assert "nothing was started" in done.stderr and "run the same command again" in done.stderr, done.stderr
    assert "resumerge resume" not in done.stderr


def test_a_model_named_by_its_weights_file_is_told_to_name_the_folder(
        tmp_path: Path, models: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``model: ./x/model.safetensors`` said "no such directory — Hugging Face Hub ids are not supported by this
    version": hub ids are supported, and the file exists."""
    shutil.copytree(models[0], tmp_path / "x")
    (tmp_path / "x" / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": "./x/model.safetensors", "parameters": {"weight": 0.5}},
        {"model": str(models[1]), "parameters": {"weight": 0.5}}]})
    assert main(["plan", str(cfg)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "'./x/model.safetensors' is a file: a model is a folder" in err and "name its folder: ./x" in err, err
    assert "not supported" not in err


@pytest.mark.parametrize("budget_mb", [100, 179, 180, 200, 260, 261, 274, 300])
@pytest.mark.parametrize("prepass_mb", [0, 54])
def test_the_memory_line_agrees_with_the_verdict(budget_mb: int, prepass_mb: int) -> None:
    """``plan`` printed "peak about 261 MB … under a 200 MB budget" then "fits" (the verdict counted anonymous memory
    only), and for a hidden-gate MoE config a peak of 614 MB then "fits" under 560 MB: the budget counts the whole
    process now, and "fits" never goes with a printed peak over the budget (issue 71)."""
    memory = MemoryEstimate(budget=budget_mb * MB, budget_source="--max-memory", machine_bytes=8000 * MB,
                            baseline_bytes=260 * MB, counted_baseline_bytes=179 * MB, working_set_bytes=MB,
                            largest_unit_bytes=MB, smallest_budget=275 * MB, prepass_bytes=prepass_mb * MB,
                            prepass_beside=True)
    line, fits = memory_line(memory), memory.over_budget() is None
    assert fits == (memory.peak_bytes <= memory.budget), (line, memory.peak_bytes)
    assert ("under a" in line) == (memory.peak_bytes <= memory.budget and memory.smallest_budget <= memory.budget)
    assert f"the smallest budget that works is {format_size(memory.smallest_budget)}" in line, line
    if not fits:
        assert "over the" in line or "more than the" in line, line


def test_an_estimate_and_a_plan_show_plans_short_text_in_a_notebook(
        tmp_path: Path, models: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Their reprs were the whole plan, every tensor: 255-257 KB in a notebook cell for SmolLM2-135M."""
    cfg = write_config(tmp_path / "c.yml", linear_config(*models))
    estimate, plan = api.estimate(cfg, tmp_path / "out", probe_size=0), api.plan_merge(cfg)
    # A notebook shows a class's own __repr__ (IPython's pretty printer uses it when the class defines one).
    shown, planned = repr(estimate), repr(plan)
    assert len(shown) < 3000 and len(planned) < 1000, (len(shown), len(planned))
    headline = f"linear: {len(plan.tensors)} tensors, {plan.num_layers} layers"
    assert shown.startswith(headline) and planned.startswith(headline)
    assert shown.splitlines()[-1] == "fits"
    assert main(["plan", str(cfg), str(tmp_path / "out"), "--probe-size", "0"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == shown.splitlines()[0] and printed[-1] == "fits"

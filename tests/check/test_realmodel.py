"""``resumerge check`` on real trained weights (SmolLM2-135M-Instruct, :mod:`realmodel`): a merge with itself
works with KL 0; a copy of the base checked as a blend of the base and a changed parent has no effect; a copy
with one layer scaled up is broken and that layer is named; NaNs are broken in the static pass; a check killed
mid-pass (SIGKILL) resumes and gives the same report.

The models are made once per module (hard links where a file is the base's own); the texts are two short lines,
so that each check is a few seconds of CPU for each model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from realmodel import edited_copy, linked_copy, smollm2_folder
from support import cli, write_config

from resumerge import api
from resumerge.analyses.check.report import BROKEN, NO_EFFECT, WORKS, CheckReport
from resumerge.errors import EXIT_BROKEN, EXIT_NO_EFFECT

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SCALED_LAYER = 12
NAN_TENSOR = "model.layers.3.mlp.down_proj.weight"
TEXTS = "The quick brown fox jumps over the lazy dog.\nIn 1492, Columbus sailed across the Atlantic Ocean.\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    base = smollm2_folder()
    root = tmp_path_factory.mktemp("real")
    generator = torch.Generator().manual_seed(0)

    def changed(name: str, t: torch.Tensor) -> torch.Tensor:  # a fine-tune-like nudge of every layer's weight
        if ".layers." not in name or t.dim() != 2:
            return t
        # (in place on the noise: the 135M-weight model's nudge made three full-size temporaries per matrix)
        return torch.randn(t.shape, generator=generator).mul_(0.05 * t.std()).add_(t)

    def scaled(name: str, t: torch.Tensor) -> torch.Tensor:  # one layer's writes into the residual, 4x
        return t * 4 if name.startswith(f"model.layers.{SCALED_LAYER}.") and name.endswith(
            ("o_proj.weight", "down_proj.weight")) else t

    def nan(name: str, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, float("nan")) if name == NAN_TENSOR else t

    texts = root / "texts.txt"
    texts.write_text(TEXTS)
    return {"base": base, "copy": linked_copy(base, root / "copy"),
            "changed": edited_copy(base, root / "changed", changed),
            "scaled": edited_copy(base, root / "scaled", scaled),
            "nan": edited_copy(base, root / "nan", nan), "texts": texts}


def _figures(report: CheckReport) -> dict[str, Any]:
    return {m.role: (m.nll, m.kl) for m in report.models}


def test_a_copy_of_the_base_checked_as_a_blend_has_no_effect(models: dict[str, Path], tmp_path: Path) -> None:
    report = api.check(models["copy"], base=models["base"], parents=[models["base"], models["changed"]],
                       prompts=models["texts"], settings=api.Settings(state_dir=tmp_path))
    print("no-effect", report.verdict, _figures(report), report.reasons)
    assert report.verdict == NO_EFFECT and report.exit_code == EXIT_NO_EFFECT, report.reasons
    assert any("indistinguishable from the base" in r for r in report.reasons)
    assert any(r.startswith("mlp:") for r in report.static.unmoved)  # the static pass names what did not move
    assert report.models[1].kl == 0.0 and (report.models[3].kl or 0) > 0


def test_a_copy_with_one_layer_scaled_up_is_broken_at_that_layer(models: dict[str, Path], tmp_path: Path) -> None:
    report = api.check(models["scaled"], base=models["base"], parents=[models["changed"]],
                       prompts=models["texts"], settings=api.Settings(state_dir=tmp_path))
    print("scaled", report.verdict, _figures(report), report.reasons)
    assert report.verdict == BROKEN and report.exit_code == EXIT_BROKEN
    assert report.broken_layer == SCALED_LAYER


def test_nans_are_broken_in_the_static_pass(models: dict[str, Path], tmp_path: Path) -> None:
    report = api.check(models["nan"], base=models["base"], prompts=models["texts"],
                       settings=api.Settings(state_dir=tmp_path))
    assert report.verdict == BROKEN and report.static.nonfinite == (NAN_TENSOR,)
    assert all(m.nll is None for m in report.models)  # no forward over NaNs
    assert not list(tmp_path.rglob("layer-*.safetensors"))


def test_a_killed_check_resumes_with_the_same_report(models: dict[str, Path], tmp_path: Path) -> None:
    argv = ["check", models["copy"], "--parent", models["changed"], "--prompts", models["texts"], "--json",
            "--state-dir", tmp_path / "killed"]
    killed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_check_layer:9"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    journal = list((tmp_path / "killed").rglob("layer-*.safetensors"))
    assert [p.name for p in journal] == ["layer-00008.safetensors"]  # one file: the last layer done
    # Resumed at layer 9, it passes the point 21 times (layers 9-29): a check started over would die at the 22nd.
    resumed = cli(*argv, env={"RESUMERGE_KILL_AT": "after_check_layer:22"}, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    doc = json.loads(resumed.stdout)
    assert doc["verdict"] == "works" and doc["broken_layer"] is None
    assert [(m["role"], m["path"]) for m in doc["models"]] == [("merge", str(models["copy"])),
                                                               ("parent", str(models["changed"]))]
    assert doc["models"][0]["nll"] > 0 and doc["models"][1]["kl"] > 0
    whole = api.check(models["copy"], parents=[models["changed"]], prompts=models["texts"],
                      settings=api.Settings(state_dir=tmp_path / "whole"))
    same = json.loads(json.dumps(whole.to_json()))
    # Each report names its own chart (under its own state dir); the charts themselves are the same bytes.
    assert Path(doc.pop("chart")).read_bytes() == Path(same.pop("chart")).read_bytes()
    assert doc == same
    assert not list((tmp_path / "killed").rglob("layer-*.safetensors"))  # a finished check keeps its report only


def test_bad_input_is_one_line_and_exit_2(models: dict[str, Path], tmp_path: Path) -> None:
    from resumerge.cli.commands import main

    assert main(["check", str(tmp_path / "nowhere"), "--state-dir", str(tmp_path)]) == 2
    # A budget that cannot hold one layer: refused before any weight is read, naming the budget that fits.
    code = main(["check", str(models["copy"]), "--parent", str(models["base"]), "--prompts", str(models["texts"]),
                 "--max-memory", "20MB", "--state-dir", str(tmp_path)])
    assert code == 2 and not list(tmp_path.rglob("layer-*"))


@pytest.fixture(scope="module")
def self_merged(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A resumerge output (the base merged with itself), its state dir, and its config."""
    root = tmp_path_factory.mktemp("self")
    config = write_config(root / "self.yml", {"merge_method": "linear", "models": [
        {"model": str(models["base"]), "parameters": {"weight": 0.5}},
        {"model": str(models["base"]), "parameters": {"weight": 0.5}}]})
    api.run(config, root / "out", settings=api.Settings(state_dir=root / "state"))
    return root / "out", root / "state", config


def _check_events(out: Path, state: Path) -> list[dict[str, Any]]:
    import sqlite3

    from resumerge.config.locations import RunLocations

    with sqlite3.connect(RunLocations.of(out, state).ledger) as db:
        return [json.loads(row[0]) for row in db.execute("SELECT data FROM events WHERE kind = 'check'")]


def test_a_merge_with_itself_works_with_kl_zero_and_status_shows_its_checks_layer_and_model(
        models: dict[str, Path], self_merged: tuple[Path, Path, Path]) -> None:
    """The module's self-merge (a merge of SmolLM2 is ~4 CPU s) checked against the parents its record names: killed
    mid-pass, ``status`` shows the check's layer and model and the ledger holds no verdict; resumed, it works with
    KL 0 (the check a resume finishes is the one a check never killed makes: test_a_killed_check_resumes_with_the_
    same_report), and the ledger records that verdict."""
    out, state, _ = self_merged
    killed = cli("check", out, "--prompts", models["texts"], "--json", "--state-dir", state,
                 env={"RESUMERGE_KILL_AT": "after_check_layer:5"}, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    status = api.status(out, settings=api.Settings(state_dir=state))
    found = status.to_json()["check"]
    assert (found["state"], found["phase"], found["layer"], found["layers"]) == ("interrupted", "forward", 4, 30)
    assert (found["model_index"], found["model_role"], found["models"]) == (1, "parent", 2)
    assert status.details is not None and ("check", "interrupted: layer 5 of 30, model 2 of 2 (parent "
                                           f"{models['base']})") in status.details.rows
    assert _check_events(out, state) == []  # no verdict yet, no record
    report = api.check(out, prompts=models["texts"], settings=api.Settings(state_dir=state))  # resumes
    print("self-merge", report.verdict, _figures(report), report.reasons)
    assert report.verdict == WORKS and report.exit_code == 0, report.reasons
    assert [m.role for m in report.models] == ["merge", "parent"]
    assert report.models[1].kl == 0.0 and report.models[1].top1 == 1.0
    assert report.models[0].nll == report.models[1].nll
    assert report.broken_layer is None and not report.static.nonfinite
    assert report.chart is not None and Path(report.chart).read_bytes().startswith(b"\x89PNG")
    found = api.status(out, settings=api.Settings(state_dir=state)).to_json()["check"]
    assert (found["state"], found["verdict"], found["exit_code"]) == ("done", "works", 0)
    events = _check_events(out, state)
    assert [(e["verdict"], e["exit_code"], e["broken_layer"]) for e in events] == [("works", 0, None)]
    assert [(m["role"], m["nll"], m["kl"]) for m in events[0]["models"]] == [
        (m.role, m.nll, m.kl) for m in report.models]


def test_run_check_checks_the_output_and_exits_with_the_verdicts_code(
        models: dict[str, Path], self_merged: tuple[Path, Path, Path], tmp_path: Path) -> None:
    from resumerge.cli.commands import main

    _, _, config = self_merged
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["run", str(config), str(out), "--check", "--state-dir", str(state), "--quiet"]) == 0
    assert [e["verdict"] for e in _check_events(out, state)] == ["works"]
    # A kind whose output is no merge of parents is refused before the run starts (exit 2).
    moe = write_config(tmp_path / "moe.yml", {"base_model": str(models["base"]), "gate_mode": "random",
                                              "experts": [{"source_model": str(models["base"])},
                                                          {"source_model": str(models["changed"])}]})
    assert main(["run", str(moe), str(tmp_path / "moe"), "--check", "--state-dir", str(state)]) == 2
    assert not (tmp_path / "moe").exists()

"""Whole merges through the CLI: correct tensors, complete outputs, determinism, and OUT-directory safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from support import digests, linear_config, output_tensors, write_config

from resumerge.cli.commands import main
from resumerge.config.locations import run_dir
from resumerge.machine.runlock import RunLock


def test_linear_merge_values_and_outputs(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b, weights=(1.0, 3.0)))
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--out-shard-size", "20k", "--quiet"]) == 0
    got, ta, tb = output_tensors(out), output_tensors(a), output_tensors(b)
    assert set(got) == set(ta)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, (ta[name] + 3 * tb[name]) / 4, rtol=1e-6, atol=1e-7)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert all((out / f).is_file() for f in index["weight_map"].values())
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "mergekit_config.yml"):
        assert (out / name).is_file()
    assert not list(out.glob(".*.part"))


def test_duplicated_layers_never_share_memory(tmp_path: Path, make: ModelFactory) -> None:
    a = make("a", layers=4, dtype=torch.bfloat16)
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 3]}]},
        {"sources": [{"model": str(a), "layer_range": [1, 4]}]},
        {"sources": [{"model": str(a), "layer_range": [2, 3], "parameters": {"scale": 0.5}}]},
    ]})
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet", "--clone-tensors"]) == 0
    got, src = output_tensors(out), output_tensors(a)
    mapping = [0, 1, 2, 1, 2, 3, 2]
    for out_layer, in_layer in enumerate(mapping):
        name = f"model.layers.{out_layer}.mlp.down_proj.weight"
        expected = src[f"model.layers.{in_layer}.mlp.down_proj.weight"]
        if out_layer == 6:
            expected = expected * 0.5
        assert torch.equal(got[name], expected)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 7


def test_same_config_gives_identical_bytes(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    for out in ("o1", "o2"):
        assert main(["run", str(cfg), str(tmp_path / out), "--out-shard-size", "30k", "--quiet"]) == 0
    assert digests(tmp_path / "o1") == digests(tmp_path / "o2")


def test_rerun_of_finished_merge_is_a_verified_no_op(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.suffix == ".safetensors"}
    assert main(["resume", str(out), "--quiet"]) == 0
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    assert before == {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.suffix == ".safetensors"}


def test_different_config_refused_unless_restart(tmp_path: Path, make: ModelFactory,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    out = tmp_path / "out"
    first = write_config(tmp_path / "c1.yml", linear_config(a, b))
    second = write_config(tmp_path / "c2.yml", linear_config(a, b, weights=(0.5, 0.5)))
    assert main(["run", str(first), str(out), "--quiet"]) == 0
    (out / "NOTES.txt").write_text("mine")
    capsys.readouterr()
    assert main(["run", str(second), str(out), "--quiet"]) == 4
    err = capsys.readouterr().err
    # What changed, in the user's YAML paths and values (it said "the merge plan changed (config, ...)").
    assert "planned differently: config: models[0].parameters.weight 0.3 → 0.5; config: models[1].parameters." \
           "weight 0.7 → 0.5 —" in err, err
    assert main(["run", str(first), str(out), "--quiet", "--out-shard-size", "40k"]) == 4
    assert "planned differently: --out-shard-size 1000000000 → 40000 —" in capsys.readouterr().err
    assert main(["run", str(second), str(out), "--quiet", "--restart"]) == 0
    assert (out / "NOTES.txt").read_text() == "mine"
    ref = tmp_path / "ref"
    assert main(["run", str(second), str(ref), "--quiet"]) == 0
    assert output_tensors(out).keys() == output_tensors(ref).keys()
    for name, tensor in output_tensors(ref).items():
        assert torch.equal(output_tensors(out)[name], tensor)


def test_foreign_output_dir_is_refused_and_untouched(tmp_path: Path, make: ModelFactory,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a = make("a")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"somebody else's")
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(a)]})
    assert main(["run", str(cfg), str(out), "--quiet"]) == 4
    assert "not written by resumerge" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == b"somebody else's"
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_second_concurrent_run_is_refused(tmp_path: Path, make: ModelFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    a = make("a")
    out = tmp_path / "out"
    out.mkdir()
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(a)]})
    lock = RunLock(run_dir(out), out)
    lock.acquire()
    try:
        assert main(["run", str(cfg), str(out), "--quiet"]) == 4
        assert "another resumerge process" in capsys.readouterr().err
    finally:
        lock.release()
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0


def test_status_and_verify_json(tmp_path: Path, make: ModelFactory, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--out-shard-size", "25k", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "done"
    assert doc["tensors_done"] == doc["tensors_total"] > 0
    assert doc["shards_done"] == doc["shards_total"] > 1
    assert doc["bytes_done"] == doc["bytes_total"] == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert main(["verify", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_resume_refuses_changed_inputs_and_names_them(tmp_path: Path, make: ModelFactory,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from support import cli

    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out = tmp_path / "out"
    killed = cli("run", cfg, out, "--out-shard-size", "20k", "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_manifest_write:2"})
    assert killed.returncode == -9
    make("b", seed=3)  # same shapes, retrained weights
    assert main(["resume", str(out), "--quiet"]) == 4
    err = capsys.readouterr().err
    assert "changed" in err and str(b) in err and "model-0000" in err

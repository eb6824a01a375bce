"""``resumerge plan`` on hub inputs: bytes to download and to upload at the ``--bandwidth`` given, the pipelined
wall time and what bounds it, in the JSON document and the printed report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import write_config

from hub.conftest import REPO, Model
from hub.fakehub import FakeHub
from resumerge.cli.commands import main

OTHER = "org/beta"


def _config(tmp_path: Path, hub: FakeHub, models: tuple[Model, Model]) -> Path:
    hub.push(OTHER, models[1].files)
    return write_config(tmp_path / "c.yml", {
        "merge_method": "linear", "dtype": "float32",
        "models": [{"model": REPO, "parameters": {"weight": 0.4}}, {"model": OTHER, "parameters": {"weight": 0.6}}]})


def _weights(model: Model) -> int:
    return sum(len(model.files[s]) for s in model.shards)


def test_plan_estimates_hub_to_hub_at_the_given_bandwidth(tmp_path: Path, hub: FakeHub, models: tuple[Model, Model],
                                                          state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, hub, models)
    capsys.readouterr()
    argv = ["plan", str(cfg), "hf://me/merged", "--bandwidth", "1MB/100kB", "--probe-size", "0",
            "--state-dir", str(state)]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    net = doc["network"]
    assert net["down_bytes"] == _weights(models[0]) + _weights(models[1]) == doc["download"]["bytes"]
    assert net["up_bytes"] == doc["output"]["total_bytes"] > 0
    assert (net["down_bytes_per_s"], net["up_bytes_per_s"], net["source"]) == (1e6, 1e5, "--bandwidth")
    assert net["down_seconds"] == round(net["down_bytes"] / 1e6, 1)
    assert net["up_seconds"] == round(net["up_bytes"] / 1e5, 1)
    # Twice the bytes down at ten times the rate: the upload bounds it, and it takes at least the upload's time.
    assert net["bound"] == "upload" and net["seconds"] >= net["up_seconds"]
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "network about " in text and "upload-bound: download " in text
    assert "at 1.00 MB/s (--bandwidth)" in text and "at 100 kB/s (--bandwidth)" in text


def test_plan_of_a_local_out_from_hub_inputs_only_downloads(tmp_path: Path, hub: FakeHub,
                                                            models: tuple[Model, Model], state: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, hub, models)
    capsys.readouterr()
    assert main(["plan", str(cfg), str(tmp_path / "out"), "--bandwidth", "1kB", "--probe-size", "0", "--json",
                 "--state-dir", str(state)]) == 0
    net = json.loads(capsys.readouterr().out)["network"]
    assert net["up_bytes"] == 0 and net["up_seconds"] == 0.0
    # Start-up (imports, planning) comes before the first byte; --probe-size 0 probes no transfer CPU either.
    assert net["bound"] == "download" and net["down_seconds"] > 0 and net["transfer_cpu_seconds"] == 0
    assert net["seconds"] == pytest.approx(net["startup_seconds"] + net["down_seconds"], abs=0.11)


def test_plan_without_bandwidth_says_the_link_is_unknown(tmp_path: Path, hub: FakeHub, models: tuple[Model, Model],
                                                         state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, hub, models)
    capsys.readouterr()
    assert main(["plan", str(cfg), "hf://me/merged", "--state-dir", str(state), "--json"]) == 0
    net = json.loads(capsys.readouterr().out)["network"]
    # The inputs' files are too small to measure a rate on, and an upload rate is never measured.
    assert (net["source"], net["up_bytes_per_s"], net["seconds"], net["bound"]) == ("measured", None, None, None)
    assert main(["plan", str(cfg), "hf://me/merged", "--state-dir", str(state)]) == 0
    assert "unknown link: pass --bandwidth DOWN/UP" in " ".join(capsys.readouterr().out.split())


def test_a_bad_bandwidth_is_refused_before_any_download(tmp_path: Path, hub: FakeHub, models: tuple[Model, Model],
                                                        state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path, hub, models)
    hub.reset_counters()
    assert main(["plan", str(cfg), "hf://me/merged", "--bandwidth", "fast", "--state-dir", str(state)]) == 2
    assert "--bandwidth" in capsys.readouterr().err
    assert not hub.requests

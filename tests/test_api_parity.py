"""The Python API and the CLI are one tool: the same output bytes, status JSON, verify JSON and plan JSON."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import ModelFactory
from support import cli, digests, linear_config, write_config

from resumerge import api
from resumerge.cli.commands import main
from resumerge.merge.store.integrity import report_json

# What the machine says at the moment of asking (free RAM and disk, this process's own size, elapsed time).
MEASURED = {("memory", "baseline_bytes"), ("memory", "counted_baseline_bytes"), ("memory", "peak_bytes"),
            ("memory", "machine_bytes"), ("time", "startup_seconds"), ("time", "seconds"),
            ("time", "compute_seconds")}
# Per method group: the timings of the sample, not what was sampled.
MEASURED_COMPUTE = ("seconds_per_element", "seconds_per_call", "seconds", "measure_seconds")


def _json_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Any:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _without_measured(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    for section, key in MEASURED:
        doc[section].pop(key)
    for group in doc["time"]["compute"]:
        for key in MEASURED_COMPUTE:
            group.pop(key)
    doc["time"]["notes"] = [n for n in doc["time"]["notes"] if not n.startswith("compute:")]
    for disk in doc["disks"]:
        disk.pop("free_bytes")
    return doc


def test_run_status_verify_and_plan_agree(tmp_path: Path, make: ModelFactory,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    state = tmp_path / "state"
    via_api, via_cli = tmp_path / "api", tmp_path / "cli"

    planned = api.estimate(cfg, via_api, settings=api.Settings(state_dir=state,
                                                               output=api.Output(out_shard_size="30k"),
                                                               resources=api.Resources(max_memory="16GB")),
                                                               probe_size=0, )
    doc = _json_of(capsys, ["plan", str(cfg), str(via_api), "--state-dir", str(state), "--out-shard-size", "30k",
                            "--max-memory", "16GB", "--probe-size", "0", "--json"])
    assert _without_measured(doc) == _without_measured(planned.to_json())
    assert doc["fingerprint"] == api.plan_merge(cfg, settings=api.Settings(
        output=api.Output(out_shard_size="30k"))).fingerprint
    assert doc["memory"]["budget"] == 16_000_000_000 and doc["memory"]["budget_source"] == "--max-memory"

    outcome = api.run(cfg, via_api, settings=api.Settings(state_dir=state, output=api.Output(out_shard_size="30k")))
    assert main(["run", str(cfg), str(via_cli), "--state-dir", str(state), "--out-shard-size", "30k", "--quiet"]) == 0
    assert digests(via_api) == digests(via_cli)
    assert outcome.plan.fingerprint == doc["fingerprint"]
    assert sum(p.stat().st_size for p in via_api.iterdir()) == planned.output.total_bytes

    for out in (via_api, via_cli):
        shown = _json_of(capsys, ["status", str(out), "--state-dir", str(state), "--json"])
        assert shown == json.loads(json.dumps(api.status(out, settings=api.Settings(state_dir=state)).to_json()))
        assert shown["state"] == "done" and shown["resume_command"] is None
        checked = _json_of(capsys, ["verify", str(out), "--state-dir", str(state), "--json"])
        assert checked == json.loads(report_json(api.verify(out, settings=api.Settings(state_dir=state))))
    from_api, from_cli = (api.status(o, settings=api.Settings(state_dir=state)).to_json() for o in (via_api, via_cli))
    assert from_api.keys() == from_cli.keys()
    for key in ("state", "source", "tensors_total", "tensors_done", "shards_total", "shards_done", "bytes_total",
                "bytes_done", "files", "last_error", "adaptations"):
        assert from_api[key] == from_cli[key], key


def test_resume_through_the_api_and_the_cli_ends_identical(tmp_path: Path, make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    reference = tmp_path / "reference"
    api.run(cfg, reference, settings=api.Settings(output=api.Output(out_shard_size="30k")))
    outs = {"api": tmp_path / "api", "cli": tmp_path / "cli"}
    for out in outs.values():
        killed = cli("run", cfg, out, "--out-shard-size", "30k", "--quiet",
                     env={"RESUMERGE_KILL_AT": "after_manifest_write:3"})
        assert killed.returncode == -signal.SIGKILL
    assert api.status(outs["api"]).to_json()["resume_command"] == f"resumerge resume {outs['api']}"
    assert api.resume(outs["api"]).resumed_files == 3
    assert main(["resume", str(outs["cli"]), "--quiet"]) == 0
    assert digests(outs["api"]) == digests(outs["cli"]) == digests(reference)

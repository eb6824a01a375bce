"""Crash consistency: real subprocesses killed with SIGKILL at every commit step and at random moments.

Every scenario ends with ``resumerge resume`` and requires every output file — shards, index, config,
tokenizer files and the manifest — to be byte-identical to an uninterrupted run of the same config. What must be
killed runs in a real process; the commands that only finish or check a scenario (the last resume, verify) run the
same CLI in this process, which saves a Python and torch start-up each (about 3 s).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from forkserver import Forked
from support import ReferenceMerge, cli, cli_here, cli_start, digests, reference_merge

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec
from resumerge.machine.killpoints import LOCAL_POINTS as POINTS

SHARD = "400k"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> ReferenceMerge:
    spec = ModelSpec(layers=8, hidden=128, intermediate=384, vocab=1000, shard_bytes=1_500_000)
    return reference_merge(tmp_path_factory.mktemp("crash"), spec, SHARD)


def _finish(setup: ReferenceMerge, out: Path, state: Path) -> None:
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == setup.reference
    assert main(["verify", str(out), "--state-dir", str(state)]) == 0


@pytest.mark.parametrize("point", POINTS)
def test_kill_point_resumes_identically(setup: ReferenceMerge, point: str) -> None:
    out, state = setup.fresh(point)
    nth = "2" if point in {"after_temp_write", "after_fsync", "mid_shard_write", "after_ledger_commit"} else "1"
    killed = cli("run", setup.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 env={"RESUMERGE_KILL_AT": f"{point}:{nth}"})
    assert killed.returncode == -signal.SIGKILL, f"{point} was never reached: {killed.stderr}"
    _finish(setup, out, state)


@pytest.mark.parametrize(("first", "second"), [("after_rename:3", "after_dir_fsync:2"),
                                               ("mid_shard_write:3", "during_config_write:1")])
def test_double_interruption_at_points(setup: ReferenceMerge, first: str, second: str) -> None:
    out, state = setup.fresh(f"double-{first}")
    args = ("--state-dir", state, "--out-shard-size", SHARD, "--quiet")
    assert cli("run", setup.config, out, *args, env={"RESUMERGE_KILL_AT": first}).returncode == -9
    assert cli("resume", out, "--state-dir", state, env={"RESUMERGE_KILL_AT": second}).returncode == -9
    _finish(setup, out, state)


def _start(setup: ReferenceMerge, out: Path, state: Path, command: str) -> Forked | subprocess.Popen[str]:
    args = ["run", str(setup.config), str(out)] if command == "run" else ["resume", str(out)]
    args += ["--state-dir", str(state), "--quiet"]
    if command == "run":
        args += ["--out-shard-size", SHARD]
    return cli_start(*args)  # a process of its own (forked from the worker's fork server), killed for real


def _kill_during_merge(proc: Forked | subprocess.Popen[str], out: Path, rng: random.Random, shards: int) -> bool:
    """SIGKILL ``proc`` at a random moment of its merge: once a random number of the shards it has left to write are
    committed, a random few milliseconds into the next one; False if it finished first. The moment is counted in
    commits, not seconds: drawn in seconds (up to 0.6 s after the manifest), a merge that starts faster outran both
    kills of a scenario, and the scenario proved nothing."""
    manifest = out / "resumerge-manifest.json"
    deadline = time.monotonic() + 60
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)

    def committed() -> int:
        return sum(1 for _ in out.glob("model-*.safetensors"))  # renamed into place: a temp file has another name

    target = committed() + rng.randrange(max(shards - committed(), 1))
    while committed() < target and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    moment = time.monotonic() + rng.uniform(0.0, 0.005)
    while time.monotonic() < moment and proc.poll() is None:
        time.sleep(0.001)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


RANDOM_SCENARIOS = [(seed, seed % 3 == 0) for seed in range(10)]


@pytest.mark.parametrize(("seed", "drop_state"), RANDOM_SCENARIOS)
def test_random_sigkills_then_resume(setup: ReferenceMerge, seed: int, drop_state: bool) -> None:
    """Two random SIGKILLs per scenario (a double interruption); some lose the whole state dir in between."""
    rng = random.Random(seed)
    out, state = setup.fresh(f"random-{seed}")
    kills = 0
    shards = sum(1 for name in setup.reference if name.startswith("model-") and name.endswith(".safetensors"))
    for attempt, command in enumerate(("run", "resume")):
        if command == "resume" and not out.exists():
            command = "run"
        proc = _start(setup, out, state, command)
        if _kill_during_merge(proc, out, rng, shards):
            kills += 1
        if drop_state and attempt == 0:
            shutil.rmtree(state, ignore_errors=True)
    if out.exists():
        _finish(setup, out, state)
    else:
        assert main(["run", str(setup.config), str(out), "--state-dir", str(state), "--out-shard-size", SHARD,
                     "--quiet"]) == 0
        assert digests(out) == setup.reference
    assert kills >= 1


def test_sigterm_stops_at_safe_point_with_exit_3(setup: ReferenceMerge) -> None:
    out, state = setup.fresh("sigterm")
    proc = cli_start("run", setup.config, out, "--state-dir", state, "--out-shard-size", "100k", "--quiet",
                     env={"RESUMERGE_KILL_AT": ""}, capture=True)
    manifest = out / "resumerge-manifest.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text() or "{}").get("committed"):
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the merge finished before the signal arrived")
    assert proc.returncode == 3, err
    assert f"resumerge resume {out}" in err
    assert not list(out.glob(".*.part"))
    status = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
    assert status["state"] == "interrupted"
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    ref = setup.root / "ref-100k"
    if not ref.exists():
        assert main(["run", str(setup.config), str(ref), "--state-dir", str(setup.root / "ref100k-state"),
                     "--out-shard-size", "100k", "--quiet"]) == 0
    assert digests(out) == digests(ref)


def test_verify_detects_damage_and_resume_repairs(setup: ReferenceMerge) -> None:
    out, state = setup.fresh("damage")
    assert main(["run", str(setup.config), str(out), "--state-dir", str(state), "--out-shard-size", SHARD,
                 "--quiet"]) == 0
    shards = sorted(out.glob("model-*.safetensors"))
    flipped, truncated = shards[1], shards[2]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 100)
    report = cli_here("verify", out, "--state-dir", state, "--json")
    assert report.returncode == 3
    damaged = {d["name"] for d in json.loads(report.stdout)["damaged"]}
    assert damaged == {flipped.name, truncated.name}
    _finish(setup, out, state)


def test_resume_from_out_alone_after_state_dir_loss(setup: ReferenceMerge) -> None:
    out, state = setup.killed("lost-state", "after_manifest_write:4", SHARD)
    shutil.rmtree(state)
    status = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
    assert status["source"] == "manifest" and status["shards_done"] == 4
    _finish(setup, out, state)

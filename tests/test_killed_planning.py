"""A run killed while it plans (before its plan is recorded) leaves its planning mark held by no process:
``status`` and ``resume`` say the run died planning and wrote nothing, and that running it again continues,
instead of a bare "no merge recorded" (a mergekit-moe config's prompt forward pass can run for minutes first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resumerge import api
from resumerge.cli.modelgen import ModelSpec
from resumerge.config.locations import ROUTERS_DIR, StateDir
from resumerge.errors import NothingRecordedError
from resumerge.machine.planning import killed_planning, planning_mark, planning_since
from tests.support import cli, digests, reference_merge

_HOLD = """
import sys, time
from pathlib import Path
from resumerge.machine.planning import planning_mark
with planning_mark(Path(sys.argv[1]), kind=sys.argv[2]):
    print("planning", flush=True)
    time.sleep(120)
"""


def _killed_while_planning(run_dir: Path, kind: str = "") -> None:
    """A real process takes the run's planning mark (naming ``kind``) and is SIGKILLed while it holds it."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir), kind], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "planning"
        assert planning_since(run_dir) is not None and killed_planning(run_dir) is None  # alive: "planning"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL


def test_status_and_resume_say_the_run_died_planning_and_that_running_it_again_continues(tmp_path: Path) -> None:
    out, state = tmp_path / "out", tmp_path / "state"
    run_dir = StateDir.resolve(state).run(out).run_dir
    _killed_while_planning(run_dir, "moe")  # a mergekit-moe run: its mark names its kind
    assert planning_since(run_dir) is None and killed_planning(run_dir) is not None
    # the MoE prompt pass had journaled two decoder layers before the kill
    work = state / ROUTERS_DIR / "0123abcd"
    work.mkdir(parents=True)
    for layer in range(2):
        (work / f"layer-{layer:05d}.safetensors").write_bytes(b"")
    said = cli("status", out, "--state-dir", state)
    assert said.returncode == 4, said.stderr
    assert "killed while planning" in said.stderr and "wrote nothing" in said.stderr
    assert f"resumerge run CONFIG {out} again" in said.stderr and "after the 2 decoder layers" in said.stderr
    assert "Traceback" not in said.stderr
    # the CLI's resume takes the mark itself before it looks: what the dead run left is kept, and said again
    for _ in range(2):
        resumed = cli("resume", out, "--state-dir", state)
        assert resumed.returncode == 4 and "killed while planning" in resumed.stderr, resumed.stderr
    with pytest.raises(NothingRecordedError, match="killed while planning"):
        api.resume(out, settings=api.Settings(state_dir=state))
    assert "killed while planning" in cli("status", out, "--state-dir", state).stderr


def test_a_mark_a_live_or_finished_run_holds_is_not_a_killed_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "state" / "run"
    with planning_mark(run_dir):
        assert planning_since(run_dir) is not None and killed_planning(run_dir) is None
    assert killed_planning(run_dir) is None and not run_dir.exists()  # taken away, with the folders it made
    run_dir.mkdir(parents=True)
    (run_dir / "planning").write_text("1700000000.0")  # what a killed run leaves: its time, no lock
    assert killed_planning(run_dir) == 1700000000.0
    with planning_mark(run_dir):  # a run that goes on and records its plan: that story is over
        assert killed_planning(run_dir) == 1700000000.0 and planning_since(run_dir) is not None
    assert killed_planning(run_dir) is None and not list(run_dir.iterdir())
    out, state = tmp_path / "out", tmp_path / "state2"
    said = cli("status", out, "--state-dir", state)
    assert said.returncode == 2 and "killed while planning" not in said.stderr  # no OUT at all: a mistyped path


def test_a_run_killed_while_hashing_its_inputs_is_recorded_and_resume_finishes_it(tmp_path: Path) -> None:
    """Hashing a new run's inputs (seconds a GB) came before its plan was recorded: 8 of 24 early kills left a ledger
    with no run in it and ``resume`` saying "run the same command again" (issue 71, item 5). The run is recorded
    first: resume finishes it, byte-identical, its inputs hashed then."""
    spec = ModelSpec(layers=2, hidden=64, intermediate=128, vocab=128, shard_bytes=60_000)
    merge = reference_merge(tmp_path, spec, "40k")
    config, reference = merge.config, merge.reference
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--state-dir", state, "--out-shard-size", "40k", "--quiet",
                 env={"RESUMERGE_KILL_AT": "before_input_hashing"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    said = cli("status", out, "--state-dir", state)
    assert "killed while planning" not in said.stdout + said.stderr, said.stdout + said.stderr
    resumed = cli("resume", out, "--state-dir", state, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert digests(out) == reference


def test_a_killed_run_s_kind_is_read_from_its_mark_never_guessed_from_the_state_dir(tmp_path: Path) -> None:
    """A merge killed while planning, beside an unfinished MoE prompt pass of another run in the same state dir: its
    mark names no MoE run, so status and resume say nothing of that pass."""
    out, state = tmp_path / "out", tmp_path / "state"
    run_dir = StateDir.resolve(state).run(out).run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "planning").write_text("1700000000.0")  # a merge's mark: its time, no kind, no lock
    work = state / ROUTERS_DIR / "0123abcd"
    work.mkdir(parents=True)
    (work / "layer-00000.safetensors").write_bytes(b"")
    for call in (lambda: api.status(out, settings=api.Settings(state_dir=state)),
                 lambda: api.resume(out, api.Settings(state_dir=state))):
        with pytest.raises(NothingRecordedError, match="killed while planning") as caught:
            call()
        assert "decoder layers" not in (caught.value.hint or "")

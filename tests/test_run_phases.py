"""A run is its phases, all in its record (issue 95): ``run --out-type gguf --imatrix-texts`` makes the importance
pass over the merge a phase of the run, recorded with the plan before it starts, then the merge and its GGUF
encoding. A kill (SIGKILL, a real process) in either leaves a recorded run that ``status`` names the phase and
progress of and ``resume`` finishes with the bytes of a run never killed; ``plan`` names each phase's memory and
refuses what ``run`` refuses; a refusal the flags decide comes before the pass; the manifest names no machine path;
``plan`` on a fresh state dir times its sample."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import pytest
import test_imatrix_merge as dense
from ggufmodels import LAYERS
from test_imatrix_merge import K_MIX

from resumerge.config.locations import StateDir
from resumerge.merge.store.ledger import Ledger
from resumerge.merge.store.statusview import read_status

MB = 1_000_000
# test_imatrix_merge's tiny merge and texts, built for this module, and its commands' 600 s bound (each run with
# --imatrix-texts starts interpreters of its own that import torch).
merge, cli = dense.merge, dense.cli


@pytest.fixture(scope="module")
def whole(merge: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The run never killed: OUT and its state dir."""
    config, texts = merge
    root = tmp_path_factory.mktemp("whole")
    done = cli("run", config, root / "out", "--state-dir", root / "state", *K_MIX, "--imatrix-texts", texts)
    assert done.returncode == 0, done.stderr
    return root / "out", root / "state"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _matrix(state: Path) -> Path:
    (found,) = (state / "imatrix").glob("*.gguf")
    return found


def _status(out: Path, state: Path) -> dict[str, object]:
    done = cli("status", out, "--state-dir", state, "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_a_kill_in_the_importance_pass_is_a_recorded_run_that_resume_finishes(
        merge: tuple[Path, Path], whole: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed once the pass's first layer is durable, the run is recorded (its plan and phases): ``status`` says
    it is interrupted in the importance pass, layer 1 of 2 done, with the command that finishes it; ``resume``
    continues the pass and finishes the GGUF and the matrix with the bytes of the run never killed, and OUT's
    manifest is that run's, byte for byte, though each had a state dir of its own."""
    config, texts = merge
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts,
                 env={"RESUMERGE_KILL_AT": "after_imatrix_layer:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    found = _status(out, state)
    assert found["state"] == "interrupted"
    assert found["phase"] == {"index": 0, "of": 2, "name": "the importance matrix pass over the merge",
                              "done": 1, "total": LAYERS, "unit": "layer"}
    assert found["resume_command"] == f"resumerge resume {out} --state-dir {state}"
    text = cli("status", out, "--state-dir", state).stdout
    assert f"the importance matrix pass over the merge (phase 1 of 2): layer 1 of {LAYERS} done" in text, text
    resumed = cli("resume", out, "--state-dir", state)
    assert resumed.returncode == 0, resumed.stderr
    assert _sha(out / "model.gguf") == _sha(whole[0] / "model.gguf")
    assert _matrix(state).read_bytes() == _matrix(whole[1]).read_bytes()
    assert (out / "resumerge-manifest.json").read_bytes() == (whole[0] / "resumerge-manifest.json").read_bytes()
    manifest = (out / "resumerge-manifest.json").read_text()
    assert str(state) not in manifest and str(whole[1]) not in manifest
    assert _status(out, state)["phase"] == {"index": 1, "of": 2, "name": "the merge and its GGUF encoding"}


def test_a_kill_in_the_encoding_is_named_by_status_and_resumed(
        merge: tuple[Path, Path], whole: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed once the GGUF's second unit is durable, ``status`` names the encoding, the last phase, with the
    tensors written; ``resume`` finds the matrix computed and finishes the same bytes."""
    config, texts = merge
    out, state = tmp_path / "out", tmp_path / "state"
    killed = cli("run", config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts, "--out-shard-size",
                 "100KB", env={"RESUMERGE_KILL_AT": "after_unit_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    found = _status(out, state)
    assert found["state"] == "interrupted"
    assert found["phase"] == {"index": 1, "of": 2, "name": "the merge and its GGUF encoding"}
    assert found["units_done"] == 2
    assert 0 < int(str(found["tensors_done"])) < int(str(found["tensors_total"]))
    text = cli("status", out, "--state-dir", state).stdout
    assert "the merge and its GGUF encoding (phase 2 of 2)" in text, text
    resumed = cli("resume", out, "--state-dir", state)
    assert resumed.returncode == 0, resumed.stderr
    assert "importance matrix found computed on the merge" in resumed.stderr, resumed.stderr
    assert _sha(out / "model.gguf") == _sha(whole[0] / "model.gguf")


def test_a_refusal_the_flags_decide_comes_before_the_pass(merge: tuple[Path, Path], tmp_path: Path) -> None:
    """OUT holds a finished merge made without a matrix: the same run with ``--imatrix-texts`` is refused (exit 4)
    before the pass computes anything, in the user's terms (the flag, never the state dir's file)."""
    config, texts = merge
    out, state = tmp_path / "out", tmp_path / "state"
    assert cli("run", config, out, "--state-dir", state, *K_MIX).returncode == 0
    refused = cli("run", config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts)
    assert refused.returncode == 4, refused.stderr
    assert "--imatrix-texts" in refused.stderr and str(state) not in refused.stderr, refused.stderr
    assert not (state / "imatrix").exists()


def test_plan_names_each_phase_and_refuses_what_run_refuses(merge: tuple[Path, Path], tmp_path: Path) -> None:
    """On a fresh state dir ``plan`` times its sample (the matrix is not computed yet) and names the pass's peak and
    smallest budget, and the merge's after it; a budget 1 MB under the larger is refused by ``plan`` and by ``run``
    (exit 2, nothing written), and the run under it finishes; its phases' peaks, as it recorded them, are within
    1.3x of ``plan``'s."""
    config, texts = merge
    out, state = tmp_path / "out", tmp_path / "state"
    args = (config, out, "--state-dir", state, *K_MIX, "--imatrix-texts", texts)
    planned = cli("plan", *args, "--json")
    assert planned.returncode == 0, planned.stderr
    found = json.loads(planned.stdout)
    assert not any("failed on a sample" in (c["note"] or "") for c in found["time"]["compute"]), found["time"]
    assert all(c["seconds_per_element"] is not None for c in found["time"]["compute"])
    first = found["first_pass"]
    smallest = found["memory"]["smallest_budget"]
    assert first["smallest_budget"] > first["peak_bytes"] > first["baseline_bytes"] > 0
    # the merge after the pass, in the process it leaves: its modules and the encoders' kernels (test_gguf_memory)
    assert smallest == max(first["smallest_budget"], first["merge_budget"])
    assert first["merge_baseline_bytes"] > first["baseline_bytes"]
    under = f"{(smallest - MB) // 1000}kB"
    assert cli("plan", *args, "--max-memory", under).returncode == 2
    refused = cli("run", *args, "--max-memory", under)
    assert refused.returncode == 2, refused.stderr
    assert "the importance matrix pass over the merge needs a budget" in refused.stderr, refused.stderr
    assert not out.exists() and not (state / "imatrix").exists()
    done = cli("run", *args, "--max-memory", f"{smallest // 1000}kB")
    assert done.returncode == 0, done.stderr
    where = StateDir.resolve(state).run(out)
    ledger = Ledger(where.ledger)
    try:
        ended = [e for e in ledger.db.query("SELECT data FROM events WHERE kind = 'phase'")
                 if json.loads(e["data"]).get("ended")]
    finally:
        ledger.close()
    (pass_peak,) = (json.loads(e["data"])["peak_bytes"] for e in ended)
    assert first["peak_bytes"] / 1.3 <= pass_peak <= first["peak_bytes"] * 1.3
    run_peak = read_status(out, StateDir.resolve(state)).peak_rss
    assert run_peak is not None
    assert found["memory"]["peak_bytes"] / 1.3 <= run_peak <= found["memory"]["peak_bytes"] * 1.3

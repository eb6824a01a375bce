"""Runs of a many-tensor model (issue 45): a kill (a real SIGKILL of a ``resumerge run`` subprocess) then a resume
ends byte-identical to an uninterrupted run without planning again, a changed input is still refused,
``status`` says "planning" while a run plans, and tiny tensors are admitted in groups. Figures at 90k tensors:
``bench/bench_many_tensors.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from resumerge import api
from resumerge.cli.commands import main
from resumerge.cli.modelgen import make_model
from resumerge.config.locations import StateDir, run_dir
from resumerge.errors import LedgerError, NothingRecordedError, PlanChangedError
from resumerge.machine.planning import PLANNING_NAME, planning_mark
from resumerge.merge.engine import session
from resumerge.merge.engine.unitgroup import GROUP_BYTES, GROUP_UNITS, group_bytes, has_room
from resumerge.merge.store.ledger_read import read_merge_record
from resumerge.merge.store.statusview import read_status
from tests.manylayers import many_layer_merge, many_layer_spec
from tests.support import cli_start, digests

# Small enough for the suite's budget, large enough that the output has many shards and planning is not instant.
LAYERS = 300
SHARD = "40k"


class Merged(NamedTuple):
    config: Path
    digests: dict[str, str]
    # what the memory governor admitted during the merge, as ``status --json`` tells it: how many, the largest
    admissions: int | None
    largest_admission: int | None


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Merged:
    """The config of two many-layer models and its uninterrupted merge."""
    root = tmp_path_factory.mktemp("many")
    config = many_layer_merge(root, LAYERS)
    ref, state = root / "reference", root / "ref-state"
    assert main(["run", str(config), str(ref), "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet"]) == 0
    shown = read_status(ref, StateDir.resolve(state)).to_json()  # what ``status --json`` prints
    return Merged(config, digests(ref), shown["admissions"], shown["largest_admission"])


def test_tiny_tensors_are_admitted_in_groups_of_one_shard(merged: Merged) -> None:
    """The per-unit hand-off (admission, pool task, writer queue) is paid once per group of consecutive tiny tensors
    of one shard, not per tensor; every merge of this module is compared with this one's bytes."""
    tensors, shards = 9 * LAYERS + 3, sum(name.endswith(".safetensors") for name in merged.digests)
    assert shards > 4
    # At most one group per GROUP_UNITS tensors, plus one cut short at each shard's end.
    assert merged.admissions is not None and 0 < merged.admissions <= -(-tensors // GROUP_UNITS) + shards
    # A group holds at most GROUP_UNITS units and group_bytes of estimates; under any budget that is a small share
    # of it, so grouping never changes which units fit.
    assert merged.largest_admission is not None and 0 < merged.largest_admission <= GROUP_BYTES
    assert has_room(GROUP_UNITS - 1, GROUP_BYTES - 1, 1, GROUP_BYTES)
    assert not has_room(GROUP_UNITS, 0, 1, GROUP_BYTES) and not has_room(1, GROUP_BYTES, 1, GROUP_BYTES)
    assert group_bytes(None) == GROUP_BYTES and group_bytes(1 << 30) == GROUP_BYTES
    assert group_bytes(32 << 20) == 2 << 20 and group_bytes(8) == 1


def _count_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the planner's calls made through the session (a resume's re-plan included)."""
    calls: list[int] = []
    real = session.build_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "build_plan", counting)
    return calls


def _kill_after_first_shard(config: Path, out: Path, state: Path) -> None:
    """Start ``resumerge run`` in a subprocess and SIGKILL it once the ledger records a committed shard."""
    proc = cli_start("run", config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet")
    ledger = run_dir(out, state) / "ledger.db"
    try:
        while proc.poll() is None:
            with contextlib.suppress(LedgerError):  # a ledger caught mid-creation: look again
                record = read_merge_record(ledger) if ledger.exists() else None
                if record is not None and record.files_done:
                    break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    record = read_merge_record(ledger)
    assert record is not None and 0 < record.files_done < len(record.files), "killed before or after the merge"


def test_kill_then_resume_is_identical_without_planning(merged: Merged, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume reloads the frozen plan; an input with other bytes is planned again and refused, one merely
    touched (same bytes, new mtime) is planned again and goes on."""
    config, reference = merged.config, merged.digests
    out, state = tmp_path / "out", tmp_path / "state"
    _kill_after_first_shard(config, out, state)
    calls = _count_plans(monkeypatch)
    weights = sorted((config.parent / "b").glob("*.safetensors"))[0]
    other = make_model(tmp_path / "other", many_layer_spec(LAYERS), seed=3) / weights.name
    os.replace(weights, tmp_path / "original")
    try:
        os.replace(other, weights)
        with pytest.raises(PlanChangedError, match="input file"):
            api.resume(out, settings=api.Settings(state_dir=state))
        assert len(calls) == 1
    finally:
        os.replace(tmp_path / "original", weights)  # the same file again, mtime and all
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert len(calls) == 1  # the frozen plan was reloaded from the ledger
    assert digests(out) == reference
    report = read_status(out, StateDir.resolve(state))
    assert report.state == "done" and report.tensors_done == report.tensors_total == 9 * LAYERS + 3
    stamp = os.stat(weights)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert len(calls) == 2  # planned again (a stat changed), to the same fingerprint
    assert digests(out) == reference


def test_status_says_planning_while_a_run_plans(tmp_path: Path) -> None:
    out, state = tmp_path / "out", tmp_path / "state"
    where = run_dir(out, state)
    with pytest.raises(NothingRecordedError):
        read_status(out, StateDir.resolve(state))
    with planning_mark(where):
        report = read_status(out, StateDir.resolve(state))
        assert report.state == "planning" and report.resume_command is None
        assert report.elapsed_seconds is not None
    assert not where.exists()  # the mark's folder goes with it when nothing else was written
    # A mark left by a killed process is not held by anyone: no longer "planning".
    where.mkdir(parents=True)
    (where / PLANNING_NAME).write_text("1.0")
    with pytest.raises(NothingRecordedError):
        read_status(out, StateDir.resolve(state))

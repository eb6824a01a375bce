"""A GGUF output is written in units (issue 71): its header, then groups of consecutive tensors of at most
``--out-shard-size`` bytes, each written in place in the file the plan laid out, fsynced and journaled with its
sha256. A run killed at every unit's every step resumes byte-identical to an uninterrupted run, re-merging only the
units it had not journaled (at most the one being written is lost); a resume that finds a journaled unit's bytes
altered writes that unit again rather than trusting it; ``verify`` re-hashes each unit and names the one that
differs; an OUT that commits files whole (a staged copy) says so and journals no unit."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from ggufmodels import linear_llama_config
from support import cli, cli_here, digests

from resumerge import api
from resumerge.machine.killpoints import UNIT_POINTS

UNIT = "500k"  # the tiny llama's 1.28 MB of Q8_0 in three units after the header
FLAGS = ("--out-type", "gguf", "--gguf-type", "q8_0", "--out-shard-size", UNIT)
PARTIAL = ".model.gguf.units.part"


class _Counting:
    """A reporter that counts the tensors the run writes (the resume's re-merged work) and keeps its messages."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.messages: list[str] = []

    def start(self, *, total_tensors: int, done_tensors: int, total_bytes: int, done_bytes: int) -> None:
        return None

    def tensor_done(self, name: str, nbytes: int) -> None:
        self.written.append(name)

    def file_done(self, name: str, kind: str) -> None:
        return None

    def message(self, text: str) -> None:
        self.messages.append(text)

    def shard_started(self, name: str, nbytes: int, tensors: int) -> None:
        return None

    def memory_budget(self, nbytes: int) -> None:
        return None


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The two tiny llama GGUF parents' merge config, and its GGUF output of an uninterrupted run."""
    root = tmp_path_factory.mktemp("units")
    config = linear_llama_config(root)
    whole = root / "whole"
    assert cli_here("run", config, whole, "--state-dir", root / "whole.state", *FLAGS).returncode == 0
    yield config, whole


def _ledger(state: Path) -> Path:
    (found,) = state.rglob("ledger.db")
    return found


def _units(state: Path) -> list[tuple[int, int, int, str, list[str]]]:
    """(index, start, end, status, tensors) of every unit the ledger journals, in order."""
    with sqlite3.connect(_ledger(state)) as conn:
        rows = conn.execute('SELECT idx, start, "end", status, tensors FROM units ORDER BY idx').fetchall()
    return [(int(i), int(s), int(e), str(st), json.loads(t)) for i, s, e, st, t in rows]


def test_out_shard_size_splits_a_gguf_file_into_units_that_tile_it(merge: tuple[Path, Path]) -> None:
    _, whole = merge
    units = _units(whole.parent / "whole.state")
    assert len(units) == 4 and all(status == "done" for *_, status, _ in units)
    assert units[0][1:3] == (0, units[1][1]) and units[0][4] == []  # the header is unit 0
    assert [u[2] for u in units[:-1]] == [u[1] for u in units[1:]]  # the units tile the file
    assert units[-1][2] == (whole / "model.gguf").stat().st_size
    status = json.loads(cli_here("status", whole, "--state-dir", whole.parent / "whole.state", "--json").stdout)
    assert (status["units_done"], status["units_total"]) == (4, 4)


@pytest.mark.slow  # a long one: its module runs first (tests/conftest.py)
def test_a_gguf_output_killed_at_every_unit_step_resumes_byte_identical_losing_at_most_one_unit(
        tmp_path: Path, merge: tuple[Path, Path]) -> None:
    config, whole = merge
    units = _units(whole.parent / "whole.state")
    tensors = {name for *_, names in units for name in names}
    # Every step of every unit (the header's and each group's), then the file's own commit: its fsync, its rename
    # (the 1st rename and directory fsync are the manifest's) and its ledger row.
    points = [f"{point}:{n}" for n in range(1, len(units) + 1) for point in UNIT_POINTS]
    points += ["after_temp_write:1", "after_fsync:1", "after_rename:2", "after_dir_fsync:2", "after_ledger_commit:1"]
    for point in points:
        out, state = tmp_path / point.replace(":", "-"), tmp_path / f"{point.replace(':', '-')}.state"
        killed = cli("run", config, out, "--state-dir", state, *FLAGS, env={"RESUMERGE_KILL_AT": point})
        assert killed.returncode == -9, f"{point} never reached: {killed.stderr}"
        name, _, nth = point.partition(":")
        kept = [u for u in _units(state) if u[3] == "done"]
        if name in UNIT_POINTS:  # units before the n-th journaled, the n-th too once its row is in: one lost at most
            assert len(kept) == int(nth) - (name != "after_unit_commit"), point
            status = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
            assert status["units_done"] == len(kept) and status["shards_done"] == 0, point
        else:
            assert len(kept) == len(units), point  # every unit written before the file's commit
        reporter = _Counting()
        api.resume(out, settings=api.Settings(state_dir=state), progress=reporter)
        assert digests(out) == digests(whole), point
        again = set(reporter.written)  # the tensors the resume merged and wrote: only the units not journaled
        assert again == tensors - {t for *_, names in kept for t in names}, point
        assert api.verify(out, settings=api.Settings(state_dir=state)).ok, point


def test_a_journaled_unit_whose_bytes_changed_is_written_again(tmp_path: Path, merge: tuple[Path, Path]) -> None:
    config, whole = merge
    out, state = tmp_path / "out", tmp_path / "state"
    assert cli("run", config, out, "--state-dir", state, *FLAGS,
               env={"RESUMERGE_KILL_AT": "after_unit_commit:3"}).returncode == -9
    index, start, end, _, names = _units(state)[1]
    with open(out / PARTIAL, "r+b") as f:  # one byte of a journaled unit flipped, the length kept
        f.seek((start + end) // 2)
        byte = f.read(1)
        f.seek((start + end) // 2)
        f.write(bytes([byte[0] ^ 1]))
    report = json.loads(cli_here("verify", out, "--state-dir", state, "--json").stdout)
    assert [d["name"] for d in report["damaged"]] == ["model.gguf"]
    assert f"unit {index} (bytes {start}-{end})" in report["damaged"][0]["problem"]
    reporter = _Counting()
    api.resume(out, settings=api.Settings(state_dir=state), progress=reporter)
    assert any(f"unit {index}" in m and "writing 1 of its units again" in m for m in reporter.messages)
    assert set(names) <= set(reporter.written)  # merged and written again, not trusted
    assert set(_units(state)[2][4]).isdisjoint(reporter.written)  # the intact unit after it was kept
    assert digests(out) == digests(whole)


def test_verify_names_the_unit_of_a_committed_gguf_that_differs(tmp_path: Path, merge: tuple[Path, Path]) -> None:
    config, whole = merge
    out, state = tmp_path / "out", tmp_path / "state"
    assert cli_here("run", config, out, "--state-dir", state, *FLAGS).returncode == 0
    index, start, end, *_ = _units(state)[2]
    data = bytearray((out / "model.gguf").read_bytes())
    data[start + 5] ^= 1
    (out / "model.gguf").write_bytes(bytes(data))
    done = cli_here("verify", out, "--state-dir", state)
    assert done.returncode == 3
    assert f"unit {index} (bytes {start}-{end}) differs" in done.stdout + done.stderr
    assert cli_here("resume", out, "--state-dir", state).returncode == 0
    assert digests(out) == digests(whole)


def test_an_out_that_commits_files_whole_says_so_and_journals_no_unit(tmp_path: Path,
                                                                      merge: tuple[Path, Path]) -> None:
    config, whole = merge
    out, state = tmp_path / "out", tmp_path / "state"
    done = cli_here("run", config, out, "--state-dir", state, "--staging-dir", tmp_path / "staging", *FLAGS)
    assert done.returncode == 0, done.stderr
    assert digests(out) == digests(whole)
    assert _units(state) == []
    status = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
    assert status["units_total"] == 0
    assert any("model.gguf committed whole" in note for note in status["plan_notes"])

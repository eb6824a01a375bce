"""What people read: status and plan tables against snapshots, progress in its three modes, and output with no
control codes when it is not an interactive terminal.

Snapshots live in ``tests/snapshots/``; after an intended change to the layout, rewrite them with
``UPDATE_SNAPSHOTS=1 python -m pytest tests/test_status_render.py`` and review the diff.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ModelFactory
from rich.console import Console
from support import cli, cli_here, drain_pty, linear_config, write_config

from resumerge import api
from resumerge.analyses.estimate.costs import (
    DiskNeed,
    Estimate,
    MemoryEstimate,
    ModelDownload,
    OutputSize,
    TimeEstimate,
)
from resumerge.cli.commands import main
from resumerge.cli.render import ProgressReporter, progress_mode, show_plan, show_status
from resumerge.config.locations import StateDir
from resumerge.merge.store.statusview import FileStatus, StatusReport, read_status

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
WIDTH = 100
ESC = "\x1b"


def _matches_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing snapshot {path}: run with UPDATE_SNAPSHOTS=1 once"
    assert text == path.read_text(), f"{name} differs from its snapshot:\n{text}"


def _status_text(report: StatusReport) -> str:
    stream = io.StringIO()
    show_status(report, stream, width=WIDTH)
    return stream.getvalue()


def _shards(done: int, total: int) -> tuple[FileStatus, ...]:
    files = [FileStatus(f"model-{i:05d}-of-{total:05d}.safetensors", "shard", "done" if i <= done else "pending",
                        4_000_000_000 if i <= done else None) for i in range(1, total + 1)]
    files += [FileStatus(n, "config", "pending", None) for n in ("config.json", "mergekit_config.yml")]
    return (*files, FileStatus("model.safetensors.index.json", "index", "pending", None))


INTERRUPTED = StatusReport(
    out_dir="/content/drive/MyDrive/merged", state="interrupted", source="ledger",
    tensors_total=291, tensors_done=120, shards_total=8, shards_done=3,
    bytes_total=29_400_000_000, bytes_done=12_000_000_000, files=_shards(3, 8),
    last_error="disk full: free disk space, then run resumerge resume", peak_rss=2_310_000_000, adaptations=2,
    elapsed_seconds=754.2, events=("state: interrupted",), budget=9_870_000_000,
    adaptation_events=("in_flight_limit 2 -> 1: host memory at 86 % of the 9.87 GB budget",),
    resume_command="resumerge resume /content/drive/MyDrive/merged --state-dir /content/resumerge-state",
)
DONE = replace(INTERRUPTED, state="done", tensors_done=291, shards_done=8, bytes_done=29_400_000_000,
               files=_shards(8, 8)[:8], last_error=None, adaptation_events=(), resume_command=None,
               elapsed_seconds=31.5)
FROM_MANIFEST = StatusReport(
    out_dir="/content/drive/MyDrive/merged", state="interrupted", source="manifest", tensors_total=57,
    tensors_done=20, shards_total=8, shards_done=3, bytes_total=208_000, bytes_done=80_700, files=_shards(3, 8),
    events=("ledger not found: figures from the manifest in OUT",),
    resume_command="resumerge resume /content/drive/MyDrive/merged",
)


@pytest.mark.parametrize(("name", "report"), [("status_interrupted.txt", INTERRUPTED), ("status_done.txt", DONE),
                                              ("status_manifest.txt", FROM_MANIFEST)])
def test_status_tables_match_their_snapshots(name: str, report: StatusReport) -> None:
    text = _status_text(report)
    assert ESC not in text
    _matches_snapshot(name, text)


def test_status_of_a_killed_real_merge(tmp_path: Path, make: ModelFactory, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, b))
    out, state = tmp_path / "out", tmp_path / "state"
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    done = cli("run", cfg, out, "--out-shard-size", "30k", "--state-dir", state, "--max-memory", "2GB",
               env={"RESUMERGE_KILL_AT": "after_manifest_write:2"})
    assert done.returncode == -signal.SIGKILL
    report = read_status(out, StateDir.resolve(state))
    assert ESC not in done.stderr and done.stderr.startswith(f"merging {report.tensors_total} of ")
    assert report.state == "interrupted" and report.budget == 2_000_000_000
    assert report.resume_command == f"resumerge resume {out} --state-dir {state}"
    shown = cli_here("status", out, "--state-dir", state)  # the killed run was a process; status here
    assert shown.returncode == 0 and ESC not in shown.stdout
    assert f"finish with  resumerge resume {out} --state-dir {state}\n" in shown.stdout
    as_json = json.loads(cli_here("status", out, "--state-dir", state, "--json").stdout)
    assert as_json == json.loads(json.dumps(report.to_json()))  # the CLI prints exactly the report
    assert as_json["budget"] == 2_000_000_000 and as_json["resume_command"] == report.resume_command

    # Times, paths and memory peaks vary from run to run: normalise them, then the layout is fixed.
    fixed = replace(report, out_dir="OUT", elapsed_seconds=1.0, peak_rss=None,
                    resume_command="resumerge resume OUT --state-dir STATE")
    _matches_snapshot("status_killed_merge.txt", _status_text(fixed))

    capsys.readouterr()
    assert main(["resume", str(out), "--state-dir", str(state)]) == 0  # never killed: in this process
    resumed = capsys.readouterr().err
    assert ESC not in resumed
    left = report.tensors_total - report.tensors_done
    assert f"merging {left} of {report.tensors_total} tensors" in resumed
    assert "progress: 100 %" in resumed
    final = read_status(out, StateDir.resolve(state))
    assert final.state == "done" and final.resume_command is None and final.peak_rss


def test_plain_progress_lines_match_their_snapshot() -> None:
    now = [0.0]
    stream = io.StringIO()
    reporter = ProgressReporter(stream=stream, mode="plain", interval=10.0, budget=9_000_000_000,
                                rss=lambda: 1_234_000_000, clock=lambda: now[0], width=WIDTH)
    reporter.start(total_tensors=6, done_tensors=2, total_bytes=3_000_000_000, done_bytes=1_000_000_000)
    for step in range(4):
        now[0] += 4.0
        reporter.tensor_done(f"t{step}", 500_000_000)
        if step % 2:
            reporter.file_done(f"model-0000{step}-of-00003.safetensors", "shard")
    reporter.message("a note from the engine")
    reporter.close()
    text = stream.getvalue()
    assert ESC not in text
    _matches_snapshot("progress_plain.txt", text)


def test_quiet_progress_prints_nothing() -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(stream=stream, quiet=True)
    reporter.start(total_tensors=1, done_tensors=0, total_bytes=10, done_bytes=0)
    reporter.tensor_done("t", 10)
    reporter.file_done("model.safetensors", "shard")
    reporter.message("note")
    reporter.close()
    assert reporter.mode == "quiet" and stream.getvalue() == ""


def test_progress_is_live_only_on_a_real_interactive_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "FORCE_COLOR", "JPY_PARENT_PID", "COLAB_RELEASE_TAG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        assert progress_mode(Console(file=tty)) == "live"
        assert progress_mode(Console(file=tty), quiet=True) == "quiet"
        monkeypatch.setenv("JPY_PARENT_PID", "1")  # a command started from a notebook cell: a pty, no redraws
        assert progress_mode(Console(file=tty)) == "plain"
        monkeypatch.delenv("JPY_PARENT_PID")
        monkeypatch.setenv("TTY_INTERACTIVE", "0")
        assert progress_mode(Console(file=tty)) == "plain"
        monkeypatch.delenv("TTY_INTERACTIVE")
        monkeypatch.setenv("TERM", "dumb")
        assert progress_mode(Console(file=tty)) == "plain"
    os.close(master)
    monkeypatch.setenv("FORCE_COLOR", "1")  # colours forced on a pipe (Jupyter kernels, CI) still cannot redraw
    assert progress_mode(Console(file=io.StringIO())) == "plain"


def test_live_progress_draws_bars_for_the_merge_the_shard_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        reporter = ProgressReporter(stream=tty, mode="live", rss=lambda: 1_500_000_000, width=WIDTH)
        reporter.start(total_tensors=2, done_tensors=0, total_bytes=2_000_000, done_bytes=0)
        reporter.memory_budget(6_000_000_000)
        reporter.shard_started("model-00001-of-00001.safetensors", 2_000_000, 2)
        reporter.tensor_done("a", 1_000_000)
        reporter.tensor_done("b", 1_000_000)
        reporter.close()
    text = drain_pty(master)
    assert ESC in text  # redrawn in place
    assert "merge" in text and "2/2 tensors" in text and "100%" in text
    assert "shard" in text and "model-00001-of-00001.safetensors" in text
    assert "RAM 1.50 GB of a 6.00 GB budget" in text


def test_plan_report_matches_its_snapshot(tmp_path: Path, make: ModelFactory) -> None:
    a = make("a", seed=1)
    cfg = write_config(tmp_path / "c.yml", linear_config(a, make("b", seed=2)))
    plan = replace(api.plan_merge(cfg), donor="/models/a", tokenizer_donor="/models/a")
    output = OutputSize("/content/drive/MyDrive/merged", 14_900_000_000, 9_800_000, 6_100, 4_990_000_000, 0,
                        None, 0)
    memory = MemoryEstimate(9_870_000_000, "default", 12_300_000_000, 330_000_000, 210_000_000, 1_180_000_000,
                            590_000_000, 0)
    disks = (DiskNeed("/content/drive/MyDrive", ("output",), 3_000_000_000, output.needed_bytes),
             DiskNeed("/content", ("state", "hub cache"), 80_000_000_000, 30_000_000_000))
    timing = TimeEstimate(29_800_000_000, 14_910_000_000, 0, 0, 180_000_000.0, 60_000_000.0, 29_800_000_000,
                          4.2, ("compute time is not included", "download time is not included (29.8 GB)"))
    downloads = {"org/model": ModelDownload("org/model", "0" * 40, 29_800_000_000, 0, 1_200_000_000)}
    estimate = Estimate(plan, output, downloads, memory, disks, timing,
                        ("disk: output needs 14.9 GB on the disk of /content/drive/MyDrive, but only 3.00 GB is free",),
                        ("a note",))
    stream = io.StringIO()
    show_plan(estimate, stream, width=WIDTH)
    text = stream.getvalue()
    assert ESC not in text and text.rstrip().endswith("but only 3.00 GB is free")
    _matches_snapshot("plan_will_not_fit.txt", text)


@pytest.mark.parametrize(("tokenizer", "said"), [
    ({"tokenizer_source": "union"}, "tokenizer built from the inputs' tokenizers"),
    ({}, "tokenizer from "),
], ids=["union", "donor"])
def test_plan_says_where_the_tokenizer_comes_from(tmp_path: Path, make: ModelFactory,
                                                  tokenizer: dict[str, str], said: str) -> None:
    """A built tokenizer (tokenizer_source: union) was shown as "tokenizer from nowhere"."""
    cfg = write_config(tmp_path / "c.yml", {**linear_config(make("a", seed=1), make("b", seed=2)), **tokenizer})
    stream = io.StringIO()
    show_plan(api.estimate(cfg, probe_size=0), stream, width=WIDTH)
    assert said in stream.getvalue() and "nowhere" not in stream.getvalue()


def _screen(drawn: str, width: int) -> list[str]:
    """What a terminal ``width`` columns wide shows after ``drawn``: it wraps long lines and obeys the few
    controls rich's live display sends (carriage return, erase line, cursor up)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    pending = False  # a character in the last column: the next one wraps
    for match in re.finditer(r"\x1b\[([0-9;?]*)([A-Za-z])|(.)", drawn, re.S):
        arg, command, char = match.groups()
        if command == "A":
            row, pending = max(0, row - int(arg or 1)), False
        elif command == "K" and arg == "2":
            rows[row] = []
        elif char == "\r":
            col, pending = 0, False
        elif char == "\n" or (char is not None and pending):
            row, col, pending = row + 1, 0, False
            rows.extend([] for _ in range(row + 1 - len(rows)))
        if char is not None and char not in "\r\n":
            rows[row].extend(" " * (col - len(rows[row])))
            rows[row][col:col + 1] = [char]
            col, pending = (width - 1, True) if col + 1 >= width else (col + 1, False)
    return ["".join(r).rstrip() for r in rows if "".join(r).strip()]


@pytest.mark.parametrize("width", [80, 120])
def test_live_bars_fit_the_terminal_and_leave_one_final_frame(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """At 80 columns "141.1/14…" wrapped to "MB" on the next line; a wrapped row also leaves a stale frame."""
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal for rich, drawn into a string
    stream = io.StringIO()
    reporter = ProgressReporter(stream=stream, mode="live", rss=lambda: 1_500_000_000, width=width)
    reporter.start(total_tensors=291, done_tensors=0, total_bytes=141_100_000, done_bytes=0)
    reporter.memory_budget(9_870_000_000)
    reporter.shard_started("model-00010-of-00010.safetensors", 141_000_000, 291)
    for i in range(291):
        reporter.tensor_done(f"t{i}", 141_000_000 // 291)
    reporter.close()
    screen = _screen(stream.getvalue(), width)
    assert [line.split()[0] for line in screen] == ["merge", "shard", "RAM"], "\n".join(screen)
    assert all(len(line) < width for line in screen), "\n".join(screen)
    assert "100% 141.1/141.1 MB" in screen[0] and "291/291 tensors" in screen[0]
    assert "100% 141.0/141.0 MB" in screen[1] and "model-00010-of-00010" in screen[1]

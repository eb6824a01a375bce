"""The randomized truncation's bytes follow torch's thread count (MKL splits its products and QRs by it: on the
168 MB bench pair -j 1 and -j 4 gave other adapters), so an extraction records -j like slerp does: reused on
resume, a different one refused."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from resumerge.cli import commands
from resumerge.cli.commands import main


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """main() in this process: its signal handlers left alone, torch's thread count restored afterwards."""
    monkeypatch.setattr(commands, "installed_stop_flag", lambda: (lambda: False))
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_the_thread_count_is_recorded_reused_and_a_different_one_refused(
        tmp_path: Path, pair: Callable[[str], tuple[Path, Path]], capsys: pytest.CaptureFixture[str],
        in_process: None) -> None:
    base, ft = pair("llama")
    out, state = tmp_path / "out", tmp_path / "state"
    assert main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out),
                 "--max-rank", "4", "-j", "1", "-q", "--state-dir", str(state)]) == 0
    assert json.loads((out / "resumerge-manifest.json").read_text())["options"]["num_threads"] == 1
    capsys.readouterr()
    assert main(["resume", str(out), "-j", "3", "--state-dir", str(state)]) == 2
    assert "started with -j 1" in capsys.readouterr().err
    assert main(["resume", str(out), "--state-dir", str(state)]) == 0
    assert "using -j 1, as the run was started with" in capsys.readouterr().err


def test_saved_whole_only_records_no_thread_count(tmp_path: Path, pair: Callable[[str], tuple[Path, Path]],
                                                  in_process: None) -> None:
    """Without a decomposed module the bytes do not follow -j: it stays out of the plan."""
    base, ft = pair("llama")
    out = tmp_path / "out"
    assert main(["extract-lora", "--model", str(ft), "--base-model", str(base), "--out-path", str(out),
                 "--max-rank", "4", "-j", "1", "-q", "--state-dir", str(tmp_path / "state"),
                 "-i", "norm"]) == 0
    assert json.loads((out / "resumerge-manifest.json").read_text())["options"]["num_threads"] is None

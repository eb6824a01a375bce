"""How the run's process reads the end of the prompt work's process: its error as the same class (the same one
line and exit code), a death by signal or a crash as one line saying so (the rerun continues the pass)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from resumerge.errors import EXIT_INTERNAL, EXIT_INVALID, ResumergeError, UsageError, exit_code_for
from resumerge.runs.moe import passproc


def _fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\ncat > /dev/null\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))


@pytest.mark.parametrize(("body", "words"), [
    ("kill -9 $$", "the prompt forward pass (process"),
    ("echo 'Traceback ...' >&2; echo 'MemoryError: out of memory' >&2; exit 1",
     "the prompt forward pass failed (exit 1): MemoryError: out of memory"),
])
def test_a_child_that_dies_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str,
                                       words: str) -> None:
    _fake_python(tmp_path, monkeypatch, body)
    with pytest.raises(ResumergeError) as caught:
        passproc.run_child({"job": "encode", "mode": "hidden"}, tmp_path)
    assert words in caught.value.one_line() and exit_code_for(caught.value) == EXIT_INTERNAL
    if "kill" in body:
        assert "killed by SIGKILL" in caught.value.message and "continues at the layer" in caught.value.one_line()


def test_the_childs_error_is_raised_again_as_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answer = ('{"error": {"class": "UsageError", "message": "too small", "hint": "rerun with --max-memory 2GB", '
              '"path": null, "yaml_path": null, "tensor": null}}')
    _fake_python(tmp_path, monkeypatch, f"echo 'a library says hello'; echo '{answer}'")
    with pytest.raises(UsageError) as caught:
        passproc.run_child({"job": "encode", "mode": "hidden"}, tmp_path)
    assert caught.value.one_line() == "too small — rerun with --max-memory 2GB"
    assert exit_code_for(caught.value) == EXIT_INVALID

"""How a command ends where its reader went away or its OUT does not exist (issue 97, item 4): a closed pipe ends
quietly with 0 or 141 (SIGPIPE's convention) whichever command wrote (rich's console answered it with exit 1, the
internal-error code, and no line); a path that names nothing is a mistyped path, exit 2 in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ModelFactory
from support import cli, write_config

from resumerge.cli.commands import EXIT_BROKEN_PIPE, main
from resumerge.errors import EXIT_INVALID


@pytest.fixture
def out(tmp_path: Path, make: ModelFactory) -> Path:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": [str(make("a"))]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 0
    return tmp_path / "out"


def _into_closed_pipe(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``resumerge ARGS`` in a fresh interpreter whose stdout is a pipe whose reader has gone (``| head`` that has
    already read its line): a forked command would write a file, not this pipe."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "resumerge", *map(str, args)], stdout=write,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    finally:
        os.close(write)


@pytest.mark.parametrize("command", ["status", "verify", "check"])
def test_a_closed_pipe_ends_every_command_quietly(command: str, out: Path) -> None:
    """``status`` draws rich's table, ``verify`` prints its line, ``check`` its report: one answer for all."""
    if command == "check":
        pytest.importorskip("transformers")
    done = _into_closed_pipe(command, out)
    assert done.returncode == EXIT_BROKEN_PIPE, done.stderr
    assert "error" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_status_into_head_ends_with_0_or_141(out: Path) -> None:
    """The issue's own line, through a shell: ``head -1`` reads the first line and goes."""
    done = subprocess.run(["bash", "-c", '"$0" -m resumerge status "$1" | head -1; exit "${PIPESTATUS[0]}"',
                           sys.executable, str(out)], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode in (0, EXIT_BROKEN_PIPE), done.stderr
    assert done.stdout.startswith(f"{out}: done") and done.stderr == ""


@pytest.mark.parametrize("command", ["status", "verify", "resume"])
def test_an_out_that_does_not_exist_is_exit_2_in_one_line(command: str, tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    done = cli(command, nowhere)
    assert done.returncode == EXIT_INVALID, done.stderr
    assert done.stderr.strip() == f"error: {nowhere}: no such folder — check the output path"

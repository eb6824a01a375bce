"""One process at a time runs a hidden-state gate pass: two runs of the same gates into two OUTs share the pass's
folder in the state dir (by content), so the second waits on the pass's lock while the first journals, then finds
the first's routers; neither deletes a layer file the other still reads, and both outputs are the routers' a run
alone gives. Real subprocesses on tiny generated Llamas (four layers, width 32)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from resumerge import api
from tests.moe.models import hidden_gates, llamas
from tests.moe.passthread import passes_on_a_thread
from tests.support import cli_start, cli_start_beside, digests

if TYPE_CHECKING:
    from tests.forkserver import Forked

pytest.importorskip("transformers")


def _until(done: Callable[[], bool], what: str, *running: Forked | subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300  # a hang fails; a machine at load 18 once needed more than 120 s
    while time.monotonic() < deadline:
        if done():
            return
        for process in running:
            assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def _waiting_on(lock: Path) -> bool:
    """Whether a process waits for the flock on ``lock`` (a blocked request: ``->`` in /proc/locks)."""
    inode = f":{lock.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def _stopped_below(process: Forked) -> bool:
    """Whether a process under ``process`` (its prompt pass's) has stopped itself (``RESUMERGE_STOP_AT``)."""
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if child.status() == psutil.STATUS_STOPPED:
                return True
        except psutil.NoSuchProcess:
            continue
    return False


def _signal(process: Forked | subprocess.Popen[str], sig: signal.Signals) -> None:
    """``sig`` to the run and its prompt pass's process."""
    for child in psutil.Process(process.pid).children(recursive=True):
        child.send_signal(sig)
    process.send_signal(sig)


@pytest.mark.slow
def test_two_runs_of_the_same_gates_at_once_both_end_with_the_routers(tmp_path: Path) -> None:
    m = llamas(tmp_path, layers=4)
    config = hidden_gates(tmp_path / "hidden.yml", m)
    alone = tmp_path / "alone"
    with passes_on_a_thread():  # the reference: its pass needs no process of its own (the two runs' below do)
        api.run(config, alone, settings=api.Settings(state_dir=tmp_path / "alone-state"))
    state = tmp_path / "state"
    routers, locks = state / "moe-routers", state / "moe-routers-locks"
    # The first's pass stops itself once its journal holds a layer; the run is stopped too (stopped processes keep
    # their lock, as slow ones would) while the second starts and reaches the pass's lock. Both forked: the second,
    # started while the first runs in the worker's fork server, from its other one (a fresh interpreter: ~4 CPU s).
    first = cli_start("run", config, tmp_path / "one", "--state-dir", state, "--quiet", capture=True,
                      env={"RESUMERGE_STOP_AT": "after_router_layer:1"})
    second = None
    try:
        _until(lambda: _stopped_below(first), "the first's pass stopped at its first layer", first)
        assert list(routers.glob("*/layer-*.safetensors"))
        _signal(first, signal.SIGSTOP)
        try:
            second = cli_start_beside("run", config, tmp_path / "two", "--state-dir", state, "--quiet", capture=True)
            (work,) = routers.iterdir()
            lock = locks / work.name
            # Waiting on the lock, or (were there none) gone through the pass, deleting the first's journal under it
            _until(lambda: second.poll() is not None or (lock.is_file() and _waiting_on(lock)),
                   "the second waiting on the pass's lock")
            assert second.poll() is None, second.communicate()
        finally:
            _signal(first, signal.SIGCONT)
        _, err_one = first.communicate(timeout=300)
        _, err_two = second.communicate(timeout=300)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
    assert first.returncode == 0, err_one[-3000:]
    assert second.returncode == 0, err_two[-3000:]
    assert digests(tmp_path / "one") == digests(alone) == digests(tmp_path / "two")
    (work,) = routers.iterdir()  # one pass, its folder holding its routers alone
    assert [p.name for p in work.iterdir()] == ["routers.safetensors"]

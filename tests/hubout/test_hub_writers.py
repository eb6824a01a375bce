"""Two writers on one repo and interrupts of hf:// merges.

Every commit names the head it expects (``parent_commit``); the stand-in hub refuses another (412), as the real one
does: a second writer stops the run with exit 4, while a commit whose answer was lost is adopted, not taken for a
second writer. Ctrl-C (a real SIGINT to a real process) commits the files already uploaded, in one last commit,
and exits 3 with the resume command; a second Ctrl-C abandons that commit at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, TIERS, Merge, repo_files
from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.locations import run_dir
from resumerge.errors import EXIT_REFUSED, OutputDirError, exit_code_for
from resumerge.machine.runlock import RunLock
from resumerge.merge.engine.interrupts import FINAL_COMMIT_WAIT
from resumerge.merge.store.manifest import MANIFEST_NAME


@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_a_second_writer_is_refused_and_what_is_committed_stays(hub: HubWriter, merge: Merge,
                                                                 tmp_path: Path) -> None:
    other: list[str] = []

    def second_writer(number: int, stage: str) -> None:
        # Another run commits to the branch just before our second commit reaches the hub.
        if (number, stage) == (2, "received"):
            other.append(hub.hub.push("alice/two", {**hub.head_files("alice/two"), "other.txt": b"x"}))

    hub.on_commit = second_writer
    with pytest.raises(OutputDirError) as caught:
        api.run(merge.config, "hf://alice/two", settings=api.Settings(state_dir=tmp_path,
                                                                      output=api.Output(out_shard_size=SHARD),
                                                                      hub=api.Hub(commit_every=2)))
    line = caught.value.one_line()
    assert f"another run is writing to hf://alice/two: its commit {other[0]} moved the branch" in line
    assert f"stop the other run, then resumerge resume hf://alice/two --state-dir {tmp_path}" in line
    assert exit_code_for(caught.value) == EXIT_REFUSED and hub.refused == 1
    # The other writer's commit and our first commit (the manifest) stand; nothing of ours was interleaved.
    assert set(repo_files(hub, "alice/two")) == {MANIFEST_NAME, "other.txt"}


def test_a_commit_whose_answer_was_lost_is_ours_not_a_second_writer(hub: HubWriter, merge: Merge,
                                                                      tmp_path: Path) -> None:
    dropped: list[int] = []

    def lose_answer(number: int, stage: str) -> bool | None:
        if (number, stage) == (2, "applied"):  # the commit happens; its answer never reaches the client
            dropped.append(number)
            return False
        return None

    hub.on_commit = lose_answer
    api.run(merge.config, "hf://alice/lost", settings=api.Settings(state_dir=tmp_path,
                                                                   output=api.Output(out_shard_size=SHARD),
                                                                   hub=api.Hub(commit_every=2)))
    assert dropped and repo_files(hub, "alice/lost") == merge.reference
    # The retry found its commit at the head (not sent again, so not refused as a stale parent).
    assert hub.refused == 0 and hub.commit_requests == hub.commits["alice/lost"]


def _start(merge: Merge, out: str, state: Path) -> subprocess.Popen[str]:
    """A real ``resumerge run`` whose batches never fill: only an interrupt's last commit can commit shards."""
    # A fresh interpreter, not the fork server: forked, the run reached its third upload sooner than the test's
    # timing of its SIGINT assumes, and one full-suite run committed a single shard where the test expects two.
    args = ["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD,
            "--commit-every", "100", "--commit-interval", "3600"]
    return subprocess.Popen([sys.executable, "-m", "resumerge", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))


@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_ctrl_c_commits_the_uploaded_files_then_exits_3(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    state, release = tmp_path / "state", threading.Event()
    proc = _start(merge, "hf://alice/ctrlc", state)

    first = hashlib.sha256(merge.reference[min(n for n in merge.reference if n.endswith(".safetensors"))]).hexdigest()

    def stall(number: int) -> None:
        # The third upload arrives (LFS: its body; Xet: its token request): one or two are uploaded. Ctrl-C, and
        # hold this upload (and any later) in flight. A batch holds leading files only, so the first shard must be
        # uploaded. A Xet upload has registered its file only once its shard is in the CAS, after its token request,
        # and the client returns from it a moment later: on a busy machine the first one may still be on its way (the
        # second may have taken its place), so the interrupt waits for the first shard to be registered, then for the
        # client to be back from it (a CI run once interrupted inside that moment, and nothing was uploaded yet).
        if number == 3:
            deadline = time.monotonic() + 20
            while hub.cas is not None and first not in hub.cas.registrations() and time.monotonic() < deadline:
                time.sleep(0.05)
            if hub.cas is not None:
                time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        if number >= 3:
            release.wait(30)

    hub.on_upload = stall
    try:
        _, err = proc.communicate(timeout=60)  # it must not wait for the upload held in flight
    finally:
        release.set()
    assert proc.returncode == 3, err
    assert "resumerge resume hf://alice/ctrlc" in err, err
    committed = repo_files(hub, "alice/ctrlc")
    shards = sorted(n for n in committed if n.endswith(".safetensors"))
    # Every file uploaded before the interrupt is committed: by the interrupt's last commit ("committing N uploaded
    # files"), or already by the run's own end, which commits the files uploaded while the last one is in flight.
    said = re.search(r"committing (\d) uploaded files?", err)
    assert said is not None or "committing" not in err, err
    # LFS: the third body arriving means the first two bodies arrived, but on a loaded machine the client may not be
    # back from the second yet (it is then in flight, abandoned, and made again by the resume): one file at least.
    assert len(shards) in ((1, 2, 3) if hub.cas is None else (1, 2)), err
    assert (int(said[1]) if said else 0) <= len(shards) and all(committed[n] == merge.reference[n] for n in shards)
    # The ledger recorded them: the resume (same machine) starts after them and ends with the local run's bytes.
    outcome = api.resume("hf://alice/ctrlc", settings=api.Settings(state_dir=state))
    assert outcome.resumed_files >= len(shards)
    assert repo_files(hub, "alice/ctrlc") == merge.reference


def test_a_second_ctrl_c_abandons_the_last_commit_at_once(hub: HubWriter, merge: Merge, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (the CLI's own signal handling, without a second start-up): SIGINT goes to the main thread.
    release = threading.Event()

    def stall(number: int) -> None:
        if number == 3:
            os.kill(os.getpid(), signal.SIGINT)
        if number >= 3:
            release.wait(30)

    def hold(number: int, stage: str) -> bool | None:
        if number == 2 and stage == "received":  # the last commit (the first was the manifest): Ctrl-C again
            os.kill(os.getpid(), signal.SIGINT)
            release.wait(30)
            return False  # and it never happens
        return None

    hub.on_upload, hub.on_commit = stall, hold
    started = time.monotonic()
    try:
        code = main(["run", str(merge.config), "hf://alice/twice", "--state-dir", str(tmp_path), "--out-shard-size",
                     SHARD, "--commit-every", "100", "--commit-interval", "3600"])
    finally:
        release.set()
    err = capsys.readouterr().err
    assert code == 3 and time.monotonic() - started < FINAL_COMMIT_WAIT, err
    assert "abandoned by a second interrupt" in err and "resumerge resume hf://alice/twice" in err, err
    assert list(repo_files(hub, "alice/twice")) == [MANIFEST_NAME]


def test_a_second_process_on_this_machine_is_refused_naming_the_repo(
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = "hf://alice/locked"
    lock = RunLock(run_dir(out, tmp_path), out, lock_out=False)  # what the first process holds
    lock.acquire()
    try:
        assert main(["run", str(merge.config), out, "--state-dir", str(tmp_path), "--out-shard-size", SHARD,
                     "--quiet"]) == EXIT_REFUSED
    finally:
        lock.release()
    assert f"another resumerge process is merging into {out}" in capsys.readouterr().err  # not hf:/… nor a folder
    assert "alice/locked" not in hub.private  # refused before the repo was created

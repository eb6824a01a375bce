"""A ``resumerge run … hf://…`` SIGKILLed while it starts, then resumed: every case ends finished, or with a one-line
refusal that names the command which starts it (``resumerge run CONFIG hf://…``), never with "try again later"
(exit 3), however often it is tried. A repo that does not exist cannot be resumed into.

The start-up phases, seen from the hub: the repo's creation (dropped unapplied: the config was read and the token
checked, nothing exists anywhere), the first request after it (the repo exists, empty: planning), the first upload and
the first commit (the first manifest, dropped unapplied). Each is resumed with the killed run's state dir and on a
fresh machine (no state dir), where the state dir holds a ledger (else the two are one case)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, Merge, repo_files
from resumerge.cli.commands import main

# The session opens the repo before it plans, and writes its ledger after the first manifest is committed: before
# that a resume finds nothing in the state dir, and "resume creates the repo and continues from the state dir" has
# nothing to continue from. Once the repo exists and is empty, the refusal (LedgerError from the session) names
# neither the repo (it prints "hf:/…") nor the command with it: that is the session's (issue 28, after its rewrite).
SESSION = pytest.mark.xfail(strict=True, reason="issue 28: the session's refusal for an empty repo names `resumerge "
                            "run CONFIG OUT` with OUT mangled to hf:/…; it lives in engine/session.py")
# The token check (with the config read before it) leaves what a repo creation dropped unapplied leaves: nothing.
PHASES = ("repo creation", pytest.param("repo created", marks=SESSION), "first upload",
          pytest.param("first commit", marks=SESSION))


def _killed_in(hub: HubWriter, merge: Merge, out: str, state: Path, phase: str) -> int:
    args = ["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet"]
    proc = subprocess.Popen([sys.executable, "-m", "resumerge", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ))
    created: list[bool] = []

    def kill() -> bool:
        proc.send_signal(signal.SIGKILL)
        return False

    def on_request(method: str, parts: list[str]) -> bool | None:
        if phase == "token check" and parts == ["api", "whoami-v2"]:
            return kill()
        if phase == "repo creation" and parts == ["api", "repos", "create"]:
            return kill()
        if phase == "repo created" and created:  # the request after the repo's creation was answered
            return kill()
        if parts == ["api", "repos", "create"]:
            created.append(True)
        return None

    def on_upload(number: int) -> None:
        if phase == "first upload":
            kill()

    def on_commit(number: int, stage: str) -> bool | None:
        return kill() if phase == "first commit" and number == first_commit + 1 and stage == "received" else None

    first_commit = hub.commit_requests
    hub.on_request, hub.on_upload, hub.on_commit = on_request, on_upload, on_commit
    try:
        return proc.wait(timeout=120)
    finally:
        hub.on_request, hub.on_upload, hub.on_commit = None, None, None


@pytest.mark.parametrize("phase", PHASES)
def test_a_run_killed_while_starting_resumes_or_names_the_command_that_starts_it(
        hub: HubWriter, merge: Merge, tmp_path: Path, phase: str, capsys: pytest.CaptureFixture[str]) -> None:
    ended: list[str] = []
    for fresh in (False, True):
        out, state = f"hf://alice/start{int(fresh)}", tmp_path / f"state{int(fresh)}"
        assert _killed_in(hub, merge, out, state, phase) == -signal.SIGKILL, phase
        alone = not any(state.rglob("ledger.db"))  # nothing in the state dir: a fresh machine is this same case
        if fresh or alone:
            shutil.rmtree(state, ignore_errors=True)
        capsys.readouterr()
        codes = [main(["resume", out, "--state-dir", str(state), "--quiet"]) for _ in range(2)]
        err = capsys.readouterr().err
        assert codes[0] == codes[1] and codes[0] in (0, 2, 4), (phase, fresh, codes, err)
        if codes[0] != 0:
            lines = [line for line in err.splitlines() if line.strip()]
            assert f"resumerge run CONFIG {out}" in err and len(lines) <= 4, err  # the refusal and its hint
            # What it says starts the merge, and finishes it.
            assert main(["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD,
                         "--quiet"]) == 0
        assert repo_files(hub, out.removeprefix("hf://")) == merge.reference, (phase, fresh)
        ended.append(f"{'fresh' if fresh or alone else 'state dir'}: "
                     f"{'finished' if codes[0] == 0 else f'exit {codes[0]}, then run finished'}")
        if alone:
            break
    print(f"{phase}: " + ", ".join(ended))

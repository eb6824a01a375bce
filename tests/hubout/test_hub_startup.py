"""A ``resumerge run … hf://…`` SIGKILLed while it starts, then resumed: every case ends finished, or with a one-line
refusal that names the command which starts it (``resumerge run CONFIG hf://…``, exit 2), never with "try again
later" (exit 3), however often it is tried. A repo that does not exist is created by ``resume`` only from a plan the
state dir holds.

The start-up order is: config read, token check, planning, the plan recorded in the ledger, the repo's creation,
the first upload, the first commit (the first manifest). The phases, seen from the hub: the token check (nothing
written anywhere yet; a kill while reading the config or planning leaves the same), the repo's creation (dropped
unapplied: the state dir holds the plan, the repo does not exist), the first request after it (the repo exists,
empty), the first upload and the first commit (dropped unapplied). Each is resumed with the killed run's state dir
and on a fresh machine (no state dir), where the state dir holds a ledger (else the two are one case)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter
from support import cli_start

from hubout.conftest import SHARD, Merge, repo_files
from resumerge.cli.commands import main

PHASES = ("token check", "repo creation", "repo created", "first upload", "first commit")


def _killed_in(hub: HubWriter, merge: Merge, out: str, state: Path, phase: str, *extra: str) -> int:
    args = ["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet", *extra]
    proc = cli_start(*args)
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
        if phase == "first upload" and parts[-2:-1] == ["xet-write-token"]:  # Xet: an upload asks for its token
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
    _kill_and_resume(hub, merge, tmp_path, phase, capsys)


@pytest.mark.parametrize("tier", ["xet"], indirect=True)
def test_a_run_killed_at_its_first_xet_upload_resumes(hub: HubWriter, merge: Merge, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The Xet tier's first upload (its token request), where the run's users are: the same ending."""
    assert hub.cas is not None
    _kill_and_resume(hub, merge, tmp_path, "first upload", capsys)


def _kill_and_resume(hub: HubWriter, merge: Merge, tmp_path: Path, phase: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    ended: list[str] = []
    for fresh in (False, True):
        out, state = f"hf://alice/start{int(fresh)}", tmp_path / f"state{int(fresh)}"
        assert _killed_in(hub, merge, out, state, phase) == -signal.SIGKILL, phase
        alone = not any(state.rglob("ledger.db"))  # nothing in the state dir: a fresh machine is this same case
        assert alone == (phase == "token check"), phase  # the plan is recorded before the repo is created
        if fresh or alone:
            shutil.rmtree(state, ignore_errors=True)
        capsys.readouterr()
        codes = [main(["resume", out, "--state-dir", str(state), "--quiet"]) for _ in range(2)]
        err = capsys.readouterr().err
        # 4: nothing recorded for OUT (the one code for it, local or hub), with the command that starts it.
        assert codes[0] == codes[1] and codes[0] in (0, 4), (phase, fresh, codes, err)
        assert codes[0] == 0 or fresh or alone, (phase, err)  # a state dir holding the plan is always continued
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


def test_a_resume_creates_the_repo_public_when_the_killed_run_said_so(hub: HubWriter, merge: Merge,
                                                                      tmp_path: Path) -> None:
    """The plan and the run's choice of visibility are recorded before the repo is created: ``resume`` (which has no
    ``--public``) creates the repo as the killed run would have."""
    out, state = "hf://alice/public-start", tmp_path / "state"
    assert _killed_in(hub, merge, out, state, "repo creation", "--public") == -signal.SIGKILL
    assert "alice/public-start" not in hub.private  # the creation was dropped: the repo does not exist
    assert main(["resume", out, "--state-dir", str(state), "--quiet"]) == 0
    assert hub.private["alice/public-start"] is False
    assert repo_files(hub, "alice/public-start") == merge.reference


def test_another_plan_for_a_repo_not_yet_created_is_refused_before_creating_it(
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The state dir holds the killed run's plan and the repo does not exist: a run of another plan is refused
    (exit 4, saying what changed, as for a repo that exists) and creates no repo; the killed run's own resume
    still finishes it."""
    out, state = "hf://alice/other-plan", tmp_path / "state"
    assert _killed_in(hub, merge, out, state, "repo creation") == -signal.SIGKILL
    code = main(["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", "30k", "--quiet"])
    err = capsys.readouterr().err
    assert code == 4 and "planned differently" in err, err
    assert "alice/other-plan" not in hub.private  # refused before the repo was created
    assert main(["resume", out, "--state-dir", str(state), "--quiet"]) == 0
    assert repo_files(hub, "alice/other-plan") == merge.reference

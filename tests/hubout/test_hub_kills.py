"""Random SIGKILL trials of hf:// merges, each resumed on a "fresh machine" (state dir, staging and HF cache
deleted): between an upload and its commit, right before and after a commit, and during a commit (applied or
not). Every trial must end with the repo a local run writes, and no LFS object may be PUT twice."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, Merge, repo_files
from resumerge import api
from resumerge.store.killpoints import HUB_POINTS
from tests.support import cli

TRIALS = 10
BATCH = ("--commit-every", "2", "--commit-interval", "0.2")


def _killed_at_point(merge: Merge, out: str, state: Path, spec: str) -> int:
    run = cli("run", merge.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet", *BATCH,
              env={"RESUMERGE_KILL_AT": spec})
    return run.returncode


def _killed_in_commit(hub: HubWriter, merge: Merge, out: str, state: Path, nth: int, applied: bool) -> int:
    """SIGKILL the merge from inside the hub while it handles commit request ``nth`` (before or after applying)."""
    args = ["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet", *BATCH]
    proc = subprocess.Popen([sys.executable, "-m", "resumerge", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ))
    first = hub.commit_requests

    def hook(number: int, stage: str) -> bool | None:
        if number - first != nth or stage != ("applied" if applied else "received"):
            return None
        proc.send_signal(signal.SIGKILL)
        return None if applied else False

    hub.on_commit = hook
    try:
        proc.wait(timeout=120)
    finally:
        hub.on_commit = None
    return proc.returncode


def test_random_sigkills_resume_from_the_repo_alone(hub: HubWriter, merge: Merge, tmp_path: Path,
                                                    hf_env: Path) -> None:
    rng = random.Random(14)
    kinds = [*HUB_POINTS, "commit_lost", "commit_applied"]  # the first trials walk each kind once
    report: list[str] = []
    for trial in range(TRIALS):
        started = time.monotonic()
        kind = kinds[trial % len(kinds)] if trial < len(kinds) else rng.choice(kinds)
        # Uploads in a run: one per file (10); commit requests: the first manifest, then batches (each holds every
        # file the newest manifest lists, so a fast merge has one or two), then the final manifest.
        nth = {"hub_after_upload": rng.randint(1, 8), "commit_lost": 2, "commit_applied": 2}.get(kind, 1)
        repo, state = f"alice/kill{trial}", tmp_path / f"state{trial}"
        out = f"hf://{repo}"
        if kind.startswith("commit_"):
            code = _killed_in_commit(hub, merge, out, state, nth, applied=kind == "commit_applied")
        else:
            code = _killed_at_point(merge, out, state, f"{kind}:{nth}")
        assert code == -signal.SIGKILL, f"trial {trial} ({kind}:{nth}) was not killed"
        before = dict(hub.puts)
        # A fresh machine: no state dir, no staging (inside it), no HF cache.
        shutil.rmtree(state)
        shutil.rmtree(hf_env, ignore_errors=True)
        # The resume runs in this process (the kill above is what needs a real process): it saves a start-up.
        outcome = api.resume(out, state_dir=tmp_path / f"fresh{trial}", commit_every=2, commit_interval=0.2)
        assert outcome.target == out
        assert repo_files(hub, repo) == merge.reference, f"trial {trial} ({kind}:{nth})"
        puts = {k: v for k, v in hub.puts.items() if k.startswith(repo + "/")}
        assert all(v == 1 for v in puts.values()), f"trial {trial}: an object was PUT twice: {puts}"
        after = sum(v - before.get(k, 0) for k, v in puts.items())
        report.append(f"{time.monotonic() - started:.1f} s {kind}:{nth}: {hub.commits[repo]} commits, "
                      f"{len(puts)} LFS objects PUT once each, {after} of them after the kill")
    print("\n".join(report))


def test_a_commit_the_ledger_missed_is_adopted_not_redone(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    out, state = "hf://alice/missed", tmp_path / "state"
    assert _killed_at_point(merge, out, state, "hub_after_commit:1") == -signal.SIGKILL
    committed = set(repo_files(hub, "alice/missed")) - {"resumerge-manifest.json"}
    outcome = api.resume(out, state_dir=state)  # the same machine: the ledger is there, one commit behind the repo
    assert committed and any("committed with resumerge-manifest.json" in n for n in outcome.notes)
    assert repo_files(hub, "alice/missed") == merge.reference
    assert hub.deletes["alice/missed"] == 0 and all(v == 1 for v in hub.puts.values())

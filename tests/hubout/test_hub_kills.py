"""Random SIGKILL trials of hf:// merges, each resumed on a "fresh machine" (state dir, staging and HF cache
deleted): between an upload and its commit, right before and after a commit, and during a commit (applied or
not). Every trial must end with the repo a local run writes. In the LFS tier no object is PUT twice; in the Xet tier
a resume ingests again the files the killed run had not committed, but sends no chunk twice (the CAS's xorb bytes
stay those of each object once)."""

from __future__ import annotations

import hashlib
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter
from hub.fakehub_xet import XetCas

from hubout.conftest import SHARD, TIERS, Merge, repo_files, uploads
from resumerge import api
from resumerge.machine.killpoints import HUB_POINTS
from tests.support import cli, cli_start

# Each kind once, then (LFS) one more at a random point: rng 14 draws hub_after_upload:8, a kill late in the uploads
# (trial 0 drew :2). A seventh trial drew hub_after_commit:1, trial 2's state again, for 4 s of the suite's budget.
TRIALS = {"lfs": 6, "xet": 5}
BATCH = ("--commit-every", "2", "--commit-interval", "0.2")


def _killed_at_point(merge: Merge, out: str, state: Path, spec: str) -> int:
    run = cli("run", merge.config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet", *BATCH,
              env={"RESUMERGE_KILL_AT": spec})
    return run.returncode


def _killed_in_commit(hub: HubWriter, merge: Merge, out: str, state: Path, nth: int, applied: bool) -> int:
    """SIGKILL the merge from inside the hub while it handles commit request ``nth`` (before or after applying)."""
    args = ["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet", *BATCH]
    proc = cli_start(*args)
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


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_random_sigkills_resume_from_the_repo_alone(hub: HubWriter, merge: Merge, tmp_path: Path,
                                                    hf_env: Path, tier: str) -> None:
    rng = random.Random(14)
    kinds = [*HUB_POINTS, "commit_lost", "commit_applied"]  # the first trials walk each kind once
    report: list[str] = []
    shards = {hashlib.sha256(v).hexdigest(): len(v) for k, v in merge.reference.items() if k.endswith(".safetensors")}
    for trial in range(TRIALS[tier]):
        started = time.monotonic()
        kind = kinds[trial % len(kinds)] if trial < len(kinds) else rng.choice(kinds)
        # Uploads in a run: one per file (10); commit requests: the first manifest, then batches (each holds every
        # file the newest manifest lists, so a fast merge has one or two), then the final manifest.
        nth = {"hub_after_upload": rng.randint(1, 8), "commit_lost": 2, "commit_applied": 2}.get(kind, 1)
        repo, state = f"alice/kill{trial}", tmp_path / f"state{trial}"
        out = f"hf://{repo}"
        if hub.cas is not None:  # each trial its own CAS: what it received is this trial's alone
            hub.cas = XetCas(tmp_path / f"cas{trial}")
        if kind.startswith("commit_"):
            code = _killed_in_commit(hub, merge, out, state, nth, applied=kind == "commit_applied")
        else:
            code = _killed_at_point(merge, out, state, f"{kind}:{nth}")
        assert code == -signal.SIGKILL, f"trial {trial} ({kind}:{nth}) was not killed"
        before = uploads(hub, repo)
        # A fresh machine: no state dir, no staging (inside it), no HF cache, no Xet cache (local:// keeps the
        # client's shard cache in the CAS folder: that goes too).
        shutil.rmtree(state)
        shutil.rmtree(hf_env, ignore_errors=True)
        snapshot = {}
        if hub.cas is not None:
            hub.cas.forget_clients()
            snapshot = hub.cas.snapshot()
        # The resume runs in this process (the kill above is what needs a real process): it saves a start-up.
        outcome = api.resume(out, settings=api.Settings(state_dir=tmp_path / f"fresh{trial}",
                                                        hub=api.Hub(commit_every=2, commit_interval=0.2)))
        assert outcome.target == out
        assert repo_files(hub, repo) == merge.reference, f"trial {trial} ({kind}:{nth})"
        sent = uploads(hub, repo)
        assert set(sent) == set(shards), f"trial {trial}: {sent}"
        again = sum(v - before.get(k, 0) for k, v in sent.items())
        line = f"{time.monotonic() - started:.1f} s {kind}:{nth}: {hub.commits[repo]} commits, " \
               f"uploads per object {sorted(sent.values())}, {again} after the kill"
        if hub.cas is None:
            assert all(v == 1 for v in sent.values()), f"trial {trial}: an object was PUT twice: {sent}"
        else:
            # Under Xet a resume ingests again every file it did not commit (a new shard registers it), but only
            # chunks the CAS lacks are sent: the xorb bytes of the whole trial stay those of each object once.
            xorbs = sum(size for name, (size, _) in hub.cas.snapshot().items() if name.startswith("xorbs/"))
            received = hub.cas.received(snapshot)
            assert xorbs <= sum(shards.values()) * 1.02, f"trial {trial}: chunks sent twice ({xorbs} xorb bytes)"
            line += f"; xorb bytes {xorbs} for {sum(shards.values())} object bytes, resume sent " \
                    f"{received['xorbs']} xorb + {received['shards']} shard bytes"
        report.append(line)
    print("\n".join(report))


def test_a_commit_the_ledger_missed_is_adopted_not_redone(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    out, state = "hf://alice/missed", tmp_path / "state"
    assert _killed_at_point(merge, out, state, "hub_after_commit:1") == -signal.SIGKILL
    committed = set(repo_files(hub, "alice/missed")) - {"resumerge-manifest.json"}
    # the same machine: the ledger is there, one commit behind the repo
    outcome = api.resume(out, api.Settings(state_dir=state))
    assert committed and any("committed with resumerge-manifest.json" in n for n in outcome.notes)
    assert repo_files(hub, "alice/missed") == merge.reference
    assert hub.deletes["alice/missed"] == 0 and all(v == 1 for v in hub.puts.values())

"""The hub's quotas and refusals, as the real Hub words them (shared/reference/hub-real.md §1, §3): the commit quota
(429) is waited out, not failed; a full private storage (403) is exit 2 naming the quota, not the token; every
refusal shows what the hub said; a Xet token refused is a token problem; and a commit refused because the hub lost
what Xet uploaded (a recreated repo) is uploaded once more without Xet; plan warns of a private output larger than
a free account's private storage."""

from __future__ import annotations

import re
import sqlite3
from collections import deque
from pathlib import Path

import pytest
from hub.fakehub import iter_requests
from hub.fakehub_write import COMMIT_QUOTA, STORAGE_QUOTA, HubWriter, Refusal

from hubout.conftest import SHARD, Merge, repo_files, uploads
from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.locations import run_dir
from resumerge.config.settings import HOURLY_COMMITS, Batching
from resumerge.errors import EXIT_INVALID, StorageError, exit_code_for
from resumerge.merge.engine.drive import NullReporter
from resumerge.merge.store import hubcommits, hubretry
from resumerge.merge.store.hubrepo import auth_failed, is_retryable
from resumerge.merge.store.ledger import LEDGER_NAME


def _run(merge: Merge, out: str, state: Path) -> int:
    return main(["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet",
                 "--commit-every", "2", "--commit-interval", "0.2"])


class _Told(NullReporter):
    """A reporter that keeps the engine's notes."""

    def __init__(self) -> None:
        self.told: list[str] = []

    def message(self, text: str) -> None:
        self.told.append(text)


def test_the_commit_quota_is_waited_out_and_the_user_told_when(
        hub: HubWriter, merge: Merge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    waits: list[float] = []
    monkeypatch.setattr(hubcommits.CommitQueue, "_backoff", lambda self, seconds: waits.append(seconds))
    # More refusals in a row than a failing hub gets attempts: the quota is no failure, however long it lasts.
    quota = Refusal(429, COMMIT_QUOTA, ratelimit=True)
    hub.commit_faults = [None, *[quota] * (hubretry.ATTEMPTS + 1)]
    reporter = _Told()
    api.run(merge.config, "hf://alice/quota", settings=api.Settings(state_dir=tmp_path,
                                                                    output=api.Output(out_shard_size=SHARD),
                                                                    hub=api.Hub(commit_every=2, commit_interval=0.2)),
                                                                    progress=reporter,
            )
    assert repo_files(hub, "alice/quota") == merge.reference
    assert waits == [3600.0] * (hubretry.ATTEMPTS + 1)  # the hour it names, not the RateLimit bucket's 1 s
    # Told through the run's reporter (the progress display), not printed past it, and kept for `status`.
    told = [line for line in reporter.told if "commits an hour" in line]
    assert len(told) == len(waits) and "commits an hour" not in capsys.readouterr().err
    assert re.search(r"the hub allows 128 commits an hour to hf://alice/quota; waiting until \d\d:\d\d, Ctrl-C is "
                     r"safe \(then resumerge resume hf://alice/quota", told[0]), told[0]
    assert [m for m in _hub_events("hf://alice/quota", tmp_path) if "commits an hour" in m] == told


def _hub_events(out: str, state: Path) -> list[str]:
    """The ``hub`` events of the run's ledger (what the hub made the run tell the user), oldest first."""
    ledger = sqlite3.connect(run_dir(out, state) / LEDGER_NAME)
    try:
        return [m for (m,) in ledger.execute("SELECT message FROM events WHERE kind = 'hub' ORDER BY id")]
    finally:
        ledger.close()


def test_a_full_private_storage_is_exit_2_naming_the_quota_not_the_token(
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub.commit_faults = [None, Refusal(403, STORAGE_QUOTA)]  # the first batch, after its files were uploaded
    assert _run(merge, "hf://alice/full", tmp_path) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "storage quota is full" in err and STORAGE_QUOTA in err and "--public" in err, err
    assert "token" not in err and "resumerge resume hf://alice/full" in err, err
    assert hub.commit_requests == 2  # not retried: waiting does not free storage


def test_every_refusal_shows_what_the_hub_said(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    hub.commit_faults = [None, Refusal(400, "Your commit is too large for this tier")]
    with pytest.raises(StorageError) as caught:
        api.run(merge.config, "hf://alice/said", settings=api.Settings(state_dir=tmp_path,
                                                                       output=api.Output(out_shard_size=SHARD),
                                                                       hub=api.Hub(commit_every=2)))
    assert "HTTP 400: Your commit is too large for this tier" in caught.value.one_line()


@pytest.mark.parametrize("tier", ["xet"], indirect=True)
def test_a_refused_xet_token_is_the_token_message_at_once(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    hub.xet_token_faults = [401] * 20
    with pytest.raises(StorageError) as caught:
        api.run(merge.config, "hf://alice/xettoken", settings=api.Settings(state_dir=tmp_path,
                                                                           output=api.Output(out_shard_size=SHARD)))
    assert "refused the token while uploading" in caught.value.message
    assert "set HF_TOKEN" in str(caught.value.hint) and exit_code_for(caught.value) == 3
    shards = [n for n in merge.reference if n.endswith(".safetensors")]
    assert hub.xet_tokens <= len(shards)  # not retried as a network fault: each upload asked once at most


def test_hf_xets_authentication_error_is_a_token_problem() -> None:
    import hf_xet

    refused = hf_xet.XetAuthenticationError("token expired")
    assert auth_failed(refused) and not is_retryable(refused)
    assert is_retryable(ConnectionError("Network error: connection reset")) and not auth_failed(ConnectionError("x"))


@pytest.mark.parametrize("tier", ["xet"], indirect=True)
def test_a_recreated_repo_gets_its_uploads_once_more_without_xet(
        hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    assert hub.cas is not None
    hub.recreated.add("alice/again")  # the Hub's commits refuse what only Xet holds for this repo (#3829)
    assert _run(merge, "hf://alice/again", tmp_path) == 0
    assert repo_files(hub, "alice/again") == merge.reference
    said = _hub_events("hf://alice/again", tmp_path)  # what the run's display showed, kept for `status`
    assert any("uploading them once more without Xet" in m for m in said), said
    shards = [n for n in merge.reference if n.endswith(".safetensors")]
    # Each shard went through Xet once, was refused at the commit, and was PUT once through the LFS batch API.
    assert all(v == 1 for v in uploads(hub, "alice/again").values()) and len(hub.puts) == len(shards)
    assert all(v == 1 for v in hub.puts.values()) and hub.commits["alice/again"] >= 2
    refused = [r for r in iter_requests(hub.hub, "POST") if "/commit/" in r.path and r.status == 400]
    assert refused and len(refused) < hub.commits["alice/again"]  # each refused commit landed on its one retry


def test_plan_warns_when_a_private_output_exceeds_a_free_accounts_storage() -> None:
    from resumerge.merge.engine.hubdisk import FREE_PRIVATE_STORAGE, HubDiskNeed

    assert "--public" not in HubDiskNeed(FREE_PRIVATE_STORAGE, 5 * 10**9, None).line()
    line = HubDiskNeed(FREE_PRIVATE_STORAGE + 1, 5 * 10**9, None).line()
    assert "private (the default) it exceeds a free account's 100 GB of private storage: pass --public" in line


def _commit_times(files: int, seconds_per_file: float, batching: Batching, *, paced: bool) -> list[float]:
    """When a run commits, on a simulated clock: a file is published (and uploaded) every ``seconds_per_file``; a
    batch is due at ``every`` waiting files or ``interval`` seconds after the oldest; each commit first waits for
    :func:`~resumerge.merge.store.hubretry.pace_wait` when ``paced``; a commit takes no time."""
    recent: deque[float] = deque()
    times: list[float] = []
    waiting: list[float] = []  # publish times of the files not committed yet
    clock, published = 0.0, 0
    while published < files or waiting:
        nxt = published * seconds_per_file
        due = (waiting[0] + batching.interval if waiting else float("inf"))
        if len(waiting) >= batching.every or published == files:
            due = min(due, clock)
        if published < files and nxt < due:
            clock = max(clock, nxt)
            waiting.append(clock)
            published += 1
            continue
        clock = max(clock, due)
        if paced:
            clock += hubretry.pace_wait(recent, clock, batching.hourly)
        # Every file published by the time the commit goes out goes into it (the committer takes what waits).
        while published < files and published * seconds_per_file <= clock:
            waiting.append(published * seconds_per_file)
            published += 1
        recent.append(clock)
        times.append(clock)
        waiting.clear()
    return times


def _most_in_an_hour(times: list[float]) -> int:
    return max(sum(1 for u in times if t <= u < t + hubretry.WINDOW) for t in times)


def test_a_large_merge_stays_under_the_lowest_commit_quota_with_the_default_batching() -> None:
    """A 405B model in the default 1 GB shards (810 shards and the small files), at any pace from two files a second
    to one every two minutes: the default batching (20 files, 60 s) never makes more than 61 commits in an hour. The
    hourly cap bounds what batching does not: 5000 small files (a small ``--out-shard-size``) at two a second ask
    for 360 commits an hour unpaced; paced, no hour holds more than ``Batching.hourly`` (100), under the hub's 128,
    and every file is still committed (in fewer, bigger commits)."""
    batching = Batching()
    assert batching.hourly == HOURLY_COMMITS < 128
    for seconds in (0.5, 1.0, 3.0, 10.0, 45.0, 120.0):
        assert _most_in_an_hour(_commit_times(820, seconds, batching, paced=False)) <= 61, seconds
    unpaced = _commit_times(5000, 0.5, batching, paced=False)
    assert _most_in_an_hour(unpaced) > 128  # the pacing is what keeps this one under, not the batching
    paced = _commit_times(5000, 0.5, batching, paced=True)
    assert _most_in_an_hour(paced) <= batching.hourly
    assert len(paced) < len(unpaced)


def test_pace_wait_counts_the_commits_of_the_last_hour_only() -> None:
    recent = deque([0.0, 10.0, 20.0])
    assert hubretry.pace_wait(recent, 30.0, 4) == 0.0
    assert hubretry.pace_wait(recent, 30.0, 3) == 3570.0  # until the commit at 0 s leaves the hour
    assert hubretry.pace_wait(recent, 3600.0, 3) == 0.0 and list(recent) == [10.0, 20.0]

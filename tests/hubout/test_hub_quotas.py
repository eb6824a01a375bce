"""The hub's quotas and refusals, as the real Hub words them (shared/reference/hub-real.md §1, §3): the commit quota
(429) is waited out, not failed; a full private storage (403) is exit 2 naming the quota, not the token; every
refusal shows what the hub said; a Xet token refused is a token problem; and a commit refused because the hub lost
what Xet uploaded (a recreated repo) is uploaded once more without Xet; plan warns of a private output larger than
a free account's private storage."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hub.fakehub import iter_requests
from hub.fakehub_write import COMMIT_QUOTA, STORAGE_QUOTA, HubWriter, Refusal

from hubout.conftest import SHARD, Merge, repo_files, uploads
from resumerge import api
from resumerge.cli.commands import main
from resumerge.errors import EXIT_INVALID, StorageError, exit_code_for
from resumerge.store import hubcommits
from resumerge.store.hubrepo import auth_failed, is_retryable


def _run(merge: Merge, out: str, state: Path) -> int:
    return main(["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet",
                 "--commit-every", "2", "--commit-interval", "0.2"])


def test_the_commit_quota_is_waited_out_and_the_user_told_when(
        hub: HubWriter, merge: Merge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    waits: list[float] = []
    monkeypatch.setattr(hubcommits.CommitQueue, "_backoff", lambda self, seconds: waits.append(seconds))
    # More refusals in a row than a failing hub gets attempts: the quota is no failure, however long it lasts.
    quota = Refusal(429, COMMIT_QUOTA, ratelimit=True)
    hub.commit_faults = [None, *[quota] * (hubcommits.ATTEMPTS + 1)]
    assert _run(merge, "hf://alice/quota", tmp_path) == 0
    assert repo_files(hub, "alice/quota") == merge.reference
    assert waits == [3600.0] * (hubcommits.ATTEMPTS + 1)  # the hour it names, not the RateLimit bucket's 1 s
    told = [line for line in capsys.readouterr().err.splitlines() if "commits an hour" in line]
    assert len(told) == len(waits)
    assert re.search(r"the hub allows 128 commits an hour to hf://alice/quota; waiting until \d\d:\d\d, Ctrl-C is "
                     r"safe \(then resumerge resume hf://alice/quota", told[0]), told[0]


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
        api.run(merge.config, "hf://alice/said", state_dir=tmp_path, out_shard_size=SHARD, commit_every=2)
    assert "HTTP 400: Your commit is too large for this tier" in caught.value.one_line()


@pytest.mark.parametrize("tier", ["xet"], indirect=True)
def test_a_refused_xet_token_is_the_token_message_at_once(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    hub.xet_token_faults = [401] * 20
    with pytest.raises(StorageError) as caught:
        api.run(merge.config, "hf://alice/xettoken", state_dir=tmp_path, out_shard_size=SHARD)
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
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert hub.cas is not None
    hub.recreated.add("alice/again")  # the Hub's commits refuse what only Xet holds for this repo (#3829)
    assert _run(merge, "hf://alice/again", tmp_path) == 0
    assert repo_files(hub, "alice/again") == merge.reference
    err = capsys.readouterr().err
    assert "uploading them once more without Xet" in err, err
    shards = [n for n in merge.reference if n.endswith(".safetensors")]
    # Each shard went through Xet once, was refused at the commit, and was PUT once through the LFS batch API.
    assert all(v == 1 for v in uploads(hub, "alice/again").values()) and len(hub.puts) == len(shards)
    assert all(v == 1 for v in hub.puts.values()) and hub.commits["alice/again"] >= 2
    refused = [r for r in iter_requests(hub.hub, "POST") if "/commit/" in r.path and r.status == 400]
    assert refused and len(refused) < hub.commits["alice/again"]  # each refused commit landed on its one retry


def test_plan_warns_when_a_private_output_exceeds_a_free_accounts_storage() -> None:
    from resumerge.engine.costs import FREE_PRIVATE_STORAGE, HubDiskNeed

    assert "--public" not in HubDiskNeed(FREE_PRIVATE_STORAGE, 5 * 10**9, None).line()
    line = HubDiskNeed(FREE_PRIVATE_STORAGE + 1, 5 * 10**9, None).line()
    assert "private (the default) it exceeds a free account's 100 GB of private storage: pass --public" in line

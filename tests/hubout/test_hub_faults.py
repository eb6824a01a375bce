"""Faults and refusals of hf:// outputs: retried 5xx and cut uploads, persistent failures and a revoked token (exit
3 with the resume command), no or read-only token and foreign namespaces (exit 2 before any weight is read),
foreign repos and other plans (exit 4, repo unchanged), and --restart deleting only resumerge's files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import READ_TOKEN, SHARD, TOKEN, Merge, repo_files
from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.locations import run_dir
from resumerge.errors import StorageError


def _run(merge: Merge, out: str, state: Path, *extra: str) -> int:
    return main(["run", str(merge.config), out, "--state-dir", str(state), "--out-shard-size", SHARD, "--quiet",
                 "--commit-every", "2", "--commit-interval", "0.2", *extra])


def test_a_500_on_a_commit_and_an_upload_cut_mid_body_are_survived(hub: HubWriter, merge: Merge,
                                                                    tmp_path: Path) -> None:
    hub.commit_faults = [None, 500]  # the first batch commit fails once (Retry-After: 0)
    hub.cut_put_after = 4000  # the first LFS PUT is cut mid-body; the client sends it again
    api.run(merge.config, "hf://alice/faults", settings=api.Settings(state_dir=tmp_path,
                                                                     output=api.Output(out_shard_size=SHARD),
                                                                     hub=api.Hub(commit_every=2)))
    assert repo_files(hub, "alice/faults") == merge.reference
    assert all(v == 1 for v in hub.puts.values())  # completed PUTs: the cut one never completed


def test_a_hub_that_keeps_failing_stops_with_exit_3_and_the_resume_command(
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub.commit_faults = [None, *[503] * 6]
    assert _run(merge, "hf://alice/down", tmp_path) == 3
    err = capsys.readouterr().err
    assert "kept failing while committing" in err and f"resumerge resume hf://alice/down --state-dir {tmp_path}" in err
    committed = repo_files(hub, "alice/down")
    assert list(committed) == ["resumerge-manifest.json"]  # the first manifest stays committed
    assert main(["resume", "hf://alice/down", "--state-dir", str(tmp_path), "--quiet"]) == 0
    assert repo_files(hub, "alice/down") == merge.reference


def test_a_token_revoked_mid_run_is_exit_3_with_what_to_do(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    def revoke(number: int, stage: str) -> None:
        if (number, stage) == (1, "applied"):
            hub.tokens.pop(TOKEN)

    hub.on_commit = revoke
    with pytest.raises(StorageError) as caught:
        api.run(merge.config, "hf://alice/revoked", settings=api.Settings(state_dir=tmp_path,
                                                                          output=api.Output(out_shard_size=SHARD)))
    assert "refused the token" in caught.value.message and TOKEN not in caught.value.one_line()
    assert "set HF_TOKEN" in str(caught.value.hint) and "resumerge resume hf://alice/revoked" in str(caught.value.hint)
    hub.on_commit = None
    hub.add_token(TOKEN, "alice", orgs=("team",))
    api.resume("hf://alice/revoked", settings=api.Settings(state_dir=tmp_path))
    assert repo_files(hub, "alice/revoked") == merge.reference


@pytest.mark.parametrize(("token", "out", "says"), [
    (None, "hf://alice/m", "needs a Hugging Face token"),
    (READ_TOKEN, "hf://alice/m", "read-only"),
    ("hf_not_a_token", "hf://alice/m", "does not accept the token"),
    (TOKEN, "hf://bob/m", "cannot create or write repos under bob"),
])
def test_no_usable_token_is_exit_2_before_anything_is_read(
        hub: HubWriter, merge: Merge, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], token: str | None, out: str, says: str) -> None:
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    opened: list[str] = []
    monkeypatch.setattr("resumerge.merge.engine.session.prepare", lambda *a, **k: opened.append("headers"))
    assert _run(merge, out, tmp_path) == 2
    err = capsys.readouterr().err
    assert says in err and "hf_" not in err.replace("hf://", "")
    assert opened == [] and not (tmp_path / "state").exists()
    assert "alice/m" not in hub.hub.repos and "bob/m" not in hub.hub.repos


def test_a_repo_with_foreign_files_is_refused_and_unchanged(hub: HubWriter, merge: Merge, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    head = hub.create_repo("alice/theirs", {"model.safetensors": b"not ours", "notes.md": b"# mine\n"})
    assert _run(merge, "hf://alice/theirs", tmp_path) == 4
    assert "holds files resumerge did not write (model.safetensors, notes.md)" in capsys.readouterr().err
    assert hub.hub.repos["alice/theirs"].branches["main"] == head and not hub.puts


def test_another_plan_is_refused_then_restart_deletes_only_planned_files(
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    api.run(merge.config, "hf://alice/redo", settings=api.Settings(state_dir=tmp_path / "a",
                                                                   output=api.Output(out_shard_size="30k")))
    files = hub.head_files("alice/redo")
    hub.hub.push("alice/redo", {**files, "notes.md": b"# the user's own file\n"})
    assert _run(merge, "hf://alice/redo", tmp_path / "b") == 4
    assert "planned differently" in capsys.readouterr().err
    commits = hub.commits["alice/redo"]
    assert _run(merge, "hf://alice/redo", tmp_path / "b", "--restart") == 0
    after = repo_files(hub, "alice/redo")
    assert after.pop("notes.md") == b"# the user's own file\n"
    assert after == merge.reference
    # The old plan's shards went in one delete commit (a 30k plan has shard names the 20k plan does not).
    assert hub.commits["alice/redo"] - commits >= 3
    assert not any((run_dir("hf://alice/redo", tmp_path / "b") / "staging").iterdir())

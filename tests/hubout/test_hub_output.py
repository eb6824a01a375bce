"""An hf:// output: the same bytes as a local run, committed in batches with the manifest, staged copies gone."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, TIERS, Merge, repo_files, uploads
from resumerge import api
from resumerge.cli.commands import main
from resumerge.config.hubtarget import parse_hub_target
from resumerge.config.locations import run_dir
from resumerge.errors import EXIT_INVALID, EXIT_REFUSED
from tests.support import cli


@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_an_hf_output_equals_a_local_run_byte_for_byte(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    state = tmp_path / "state"
    # Batches by count only: a batch due by time takes the files uploaded so far (however few, under load).
    outcome = api.run(merge.config, "hf://alice/merged", settings=api.Settings(state_dir=state,
                                                                               output=api.Output(out_shard_size=SHARD),
                                                                               hub=api.Hub(commit_every=3,
                                                                                           commit_interval=3600)))
    assert outcome.target == "hf://alice/merged"
    assert repo_files(hub, "alice/merged") == merge.reference
    assert hub.private["alice/merged"] is True
    shards = [n for n in merge.reference if n.endswith(".safetensors")]
    assert len(shards) >= 4
    # Batched: far fewer commits than files (first manifest, batches of 3, the rest, the final "done" manifest; at
    # the end a commit takes the files uploaded so far rather than wait for the last upload: one more at most).
    files = len(merge.reference) - 1
    assert hub.commits["alice/merged"] <= 3 + -(-files // 3) < files
    assert uploads(hub, "alice/merged") == {hashlib.sha256(merge.reference[n]).hexdigest(): 1 for n in shards}
    assert hub.puts if hub.cas is None else not hub.puts and hub.hub.xet_hashes
    rdir = run_dir("hf://alice/merged", state)
    assert not any((rdir / "staging").iterdir())  # every staged copy deleted once committed
    db = sqlite3.connect(rdir / "ledger.db")
    assert {r[0] for r in db.execute("SELECT status FROM files")} == {"done"}
    commits = [json.loads(r[0])["commit"] for r in db.execute("SELECT data FROM events WHERE kind = 'commit'")]
    assert commits and set(commits) <= set(hub.hub.repos["alice/merged"].commits)
    shown = cli("status", "hf://alice/merged", "--state-dir", state, "--json")
    doc = json.loads(shown.stdout)
    assert doc["state"] == "done" and doc["url"] == f"{hub.hub.url}/alice/merged" and doc["source"] == "ledger"


def test_status_answers_from_the_repo_alone(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    api.run(merge.config, "hf://team/merged@dev", settings=api.Settings(state_dir=tmp_path / "a",
                                                                        output=api.Output(out_shard_size=SHARD)))
    assert repo_files(hub, "team/merged", "dev") == merge.reference
    assert set(hub.head_files("team/merged")) == {".gitattributes"}  # main untouched
    report = api.status("hf://team/merged@dev", settings=api.Settings(state_dir=tmp_path / "elsewhere"))
    assert report.source == "manifest" and report.state == "done" and report.shards_done == report.shards_total


def test_target_parsing() -> None:
    assert parse_hub_target("hf://alice/m@feature/x").branch == "feature/x"
    for bad in ("hf://alice", "hf://a/b/c", "hf://alice/m@", "hf://-a/m", "hf://alice/m..x"):
        try:
            parse_hub_target(bad)
        except Exception as exc:
            assert "hf://NAMESPACE/NAME" in str(getattr(exc, "hint", "")), bad
        else:
            raise AssertionError(bad)


def test_verify_names_a_damaged_file_in_the_repo_and_resume_repairs_it(
        hub: HubWriter, merge: Merge, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    api.run(merge.config, "hf://alice/v", settings=api.Settings(state_dir=state,
                                                                output=api.Output(out_shard_size=SHARD)))
    assert main(["verify", "hf://alice/v", "--state-dir", str(state), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["checked"] == len(merge.reference) - 1
    files = hub.head_files("alice/v")
    shard = sorted(n for n in files if n.endswith(".safetensors"))[1]
    hub.hub.push("alice/v", {**files, shard: files[shard][:-1] + b"\0", "config.json": b"{}"})
    assert main(["verify", "hf://alice/v", "--json"]) == 3  # no ledger here: the repo's manifest is the record
    damaged = {d["name"] for d in json.loads(capsys.readouterr().out)["damaged"]}
    assert damaged == {shard, "config.json"}
    assert main(["resume", "hf://alice/v", "--state-dir", str(state), "--quiet"]) == 0
    assert repo_files(hub, "alice/v") == merge.reference


def test_plan_reports_the_disk_of_an_hf_output(merge: Merge, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", str(merge.config), "hf://alice/p", "--out-shard-size", SHARD, "--probe-size", "0"]
    assert main([*args, "--max-disk", "30k", "--json"]) == 0
    need = json.loads(capsys.readouterr().out)["hf_output"]
    shards = [len(v) for k, v in merge.reference.items() if k.endswith(".safetensors")]
    assert need == {"output_bytes": sum(shards), "largest_file": max(shards), "max_disk": 30_000,
                    "staging_bytes": 30_000}
    assert main([*args, "--max-disk", "1k"]) == 2
    assert "below the largest output shard" in capsys.readouterr().err


def test_resuming_an_hf_output_prints_no_empty_commit_warning(hub: HubWriter, merge: Merge, tmp_path: Path) -> None:
    """huggingface_hub warned "No files have been modified since last commit. Skipping to prevent empty commit."
    on every resume hf://…: the resume's first manifest commit repeats the killed run's last one."""
    state = tmp_path / "state"
    killed = cli("run", merge.config, "hf://alice/again", "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 "--commit-every", "2", env={"RESUMERGE_KILL_AT": "hub_after_commit:2"})
    assert killed.returncode == -9, killed.stderr
    resumed = cli("resume", "hf://alice/again", "--state-dir", state, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "No files have been modified" not in resumed.stderr, resumed.stderr
    assert repo_files(hub, "alice/again") == merge.reference


def test_plan_into_an_hf_output_does_not_say_no_out_was_given(merge: Merge,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """plan CONFIG hf://… printed "no OUT given: write speed unknown" though an OUT was given."""
    assert main(["plan", str(merge.config), "hf://alice/p", "--out-shard-size", SHARD, "--probe-size", "0"]) == 0
    said = capsys.readouterr()
    assert "no OUT given" not in said.out + said.err
    assert "OUT is a hub repo: upload time is not included" in said.out + said.err


def test_nothing_recorded_is_one_answer_local_or_hub(hub: HubWriter, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong OUT got exit 4 from a local resume and status but exit 2 from an hf:// resume: now one answer from
    the three commands, exit 4 for a repo with no record, and exit 2 for a local path that names nothing at all (a
    mistyped path, issue 97); ``status`` and ``verify`` of a repo the hub says does not exist are exit 2 in one line too
    (they were exit 4, "no merge recorded", as for a repo that exists)."""
    state, never = tmp_path / "state", tmp_path / "never"
    hub.create_repo("alice/never")
    for command in ("resume", "status", "verify"):
        code = main([command, "hf://alice/never", "--state-dir", str(state)])
        err = capsys.readouterr().err
        assert code == EXIT_REFUSED, (command, err)
        assert "no merge recorded" in err or "nothing to resume" in err, err
        # A repo that does not exist: status and verify say so, exit 2; resume stays exit 4 with the command that
        # starts it (a run killed before it created its repo: tests/hubout/test_hub_startup.py).
        code = main([command, "hf://alice/nowhere", "--state-dir", str(state)])
        err = capsys.readouterr().err
        if command == "resume":
            assert code == EXIT_REFUSED and "it does not exist on the hub" in err, err
        else:
            assert (code, err) == (EXIT_INVALID, "error: hf://alice/nowhere: no such repo on the hub — check the "
                                                 "output repo's name (hf://NAMESPACE/NAME)\n"), command
        code = main([command, str(never), "--state-dir", str(state)])
        err = capsys.readouterr().err
        assert (code, err) == (EXIT_INVALID, f"error: {never}: no such folder — check the output path\n"), command

"""A merge of hub models into an ``hf://`` OUT publishes no machine path (issue 95): the repo's manifest names each
hub model as its repo id at the commit the run pinned (``org/name@<sha>``), never its HF cache snapshot folder
(the user's home); a run killed after its first commit resumes on a fresh machine (no state dir, empty HF cache) at
those commits though the models' branch moved since, to the repo an uninterrupted run writes."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, SPEC, TIERS, repo_files
from resumerge import api
from resumerge.cli.modelgen import make_model
from resumerge.merge.store.manifest import MANIFEST_NAME
from tests.support import cli, linear_config, write_config


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_a_hub_models_merge_publishes_no_cache_path_and_resumes_pinned_on_a_fresh_machine(
        hub: HubWriter, tmp_path: Path, hf_env: Path, tier: str) -> None:
    pinned = {repo: hub.create_repo(repo, _files(make_model(tmp_path / repo, SPEC, seed=seed)))
              for repo, seed in (("team/alpha", 1), ("team/beta", 2))}
    config = write_config(tmp_path / "merge.yml", linear_config(Path("team/alpha"), Path("team/beta")))
    state = tmp_path / "state"
    killed = cli("run", config, "hf://alice/killed", "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 env={"RESUMERGE_KILL_AT": "hub_after_commit:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    text = repo_files(hub, "alice/killed")[MANIFEST_NAME].decode()
    assert json.loads(text)["model_dirs"] == {repo: f"{repo}@{sha}" for repo, sha in pinned.items()}
    assert "snapshots" not in text and str(hf_env) not in text and str(tmp_path) not in text
    api.run(config, "hf://alice/whole", settings=api.Settings(state_dir=tmp_path / "whole",
                                                              output=api.Output(out_shard_size=SHARD)))
    hub.create_repo("team/alpha", _files(make_model(tmp_path / "moved", SPEC, seed=3)))  # main moved on
    # A fresh machine: no state dir, no HF cache; OUT's manifest is all there is.
    shutil.rmtree(state)
    shutil.rmtree(hf_env, ignore_errors=True)
    if hub.cas is not None:
        hub.cas.forget_clients()
    api.resume("hf://alice/killed", settings=api.Settings(state_dir=tmp_path / "fresh"))
    assert repo_files(hub, "alice/killed") == repo_files(hub, "alice/whole")

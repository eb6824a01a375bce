"""A GGUF output (``--out-type gguf``, one file, gguf-split's files or a release of several types) to an ``hf://``
OUT: the repo holds the bytes a local run writes, each split file its own upload, committed whole (no unit of it is
journaled, and the run says so); killed among the split files' uploads or between commits, it resumes on a fresh
machine to the same repo."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import TIERS, repo_files
from resumerge import api
from tests.ggufmodels import linear_llama_config
from tests.support import as_on_the_hub, cli


def _gguf_merge(root: Path, split: int | None) -> tuple[Path, api.Output]:
    config = linear_llama_config(root)
    # the shard size as a local run's default (a local GGUF output's units; a hub repo commits each file whole)
    return config, api.Output(out_shard_size="1GB", out_type="gguf", gguf_type="q8_0", gguf_split_max_size=split)


@pytest.mark.parametrize("tier", TIERS, indirect=True)
@pytest.mark.parametrize("split", [None, 40_000])
def test_a_gguf_output_to_the_hub_equals_a_local_run(hub: HubWriter, tmp_path: Path, split: int | None) -> None:
    config, output = _gguf_merge(tmp_path, split)
    local = tmp_path / "local"
    api.run(config, local, settings=api.Settings(state_dir=tmp_path / "s0", output=output))
    reference = as_on_the_hub({p.name: p.read_bytes() for p in sorted(local.iterdir()) if p.is_file()})
    assert sum(n.endswith(".gguf") for n in reference) == (1 if split is None else 15)
    api.run(config, "hf://alice/gguf", settings=api.Settings(state_dir=tmp_path / "s1", output=output))
    assert repo_files(hub, "alice/gguf") == reference
    status = api.status("hf://alice/gguf", settings=api.Settings(state_dir=tmp_path / "s1"))
    assert status.units_total == 0 and any("committed whole" in note for note in status.plan_notes)


@pytest.mark.parametrize("tier", TIERS, indirect=True)
def test_a_split_gguf_output_to_the_hub_killed_resumes_on_a_fresh_machine(hub: HubWriter, tmp_path: Path,
                                                                          hf_env: Path) -> None:
    config, output = _gguf_merge(tmp_path, 40_000)
    local = tmp_path / "local"
    api.run(config, local, settings=api.Settings(state_dir=tmp_path / "s0", output=output))
    reference = as_on_the_hub({p.name: p.read_bytes() for p in sorted(local.iterdir()) if p.is_file()})
    flags = ["--out-shard-size", "1GB", "--out-type", "gguf", "--gguf-type", "q8_0", "--gguf-split-max-size", "40000",
             "--quiet", "--commit-every", "2"]
    for point in ("hub_after_upload:5", "hub_after_commit:2"):  # among the split files' uploads, and between commits
        repo, state = f"alice/{point.replace(':', '-').replace('_', '-')}", tmp_path / point
        killed = cli("run", config, f"hf://{repo}", "--state-dir", state, *flags, env={"RESUMERGE_KILL_AT": point})
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        shutil.rmtree(state)  # a fresh machine: no state dir, no staging, no HF cache
        shutil.rmtree(hf_env, ignore_errors=True)
        if hub.cas is not None:
            hub.cas.forget_clients()
        api.resume(f"hf://{repo}", settings=api.Settings(state_dir=tmp_path / f"fresh-{point}",
                                                         hub=api.Hub(commit_every=2)))
        assert repo_files(hub, repo) == reference, point


def test_a_gguf_release_to_the_hub_equals_a_local_run_killed_or_not(hub: HubWriter, tmp_path: Path,
                                                                    hf_env: Path) -> None:
    config = linear_llama_config(tmp_path)
    output = api.Output(out_shard_size="1GB", out_type="gguf", gguf_type="q8_0,q4_k_m")
    local = tmp_path / "local"
    api.run(config, local, settings=api.Settings(state_dir=tmp_path / "s0", output=output))
    reference = as_on_the_hub({p.name: p.read_bytes() for p in sorted(local.iterdir()) if p.is_file()})
    assert sorted(n for n in reference if n.endswith(".gguf")) == ["model-Q4_K_M.gguf", "model-Q8_0.gguf"]
    api.run(config, "hf://alice/release", settings=api.Settings(state_dir=tmp_path / "s1", output=output))
    assert repo_files(hub, "alice/release") == reference
    # killed once the first file is uploaded, the second not yet: a fresh machine's resume ends with the same repo
    flags = ["--out-shard-size", "1GB", "--out-type", "gguf", "--gguf-type", "q8_0,q4_k_m", "--quiet"]
    killed = cli("run", config, "hf://alice/killed", "--state-dir", tmp_path / "s2", *flags,
                 env={"RESUMERGE_KILL_AT": "hub_after_upload:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    shutil.rmtree(tmp_path / "s2")
    shutil.rmtree(hf_env, ignore_errors=True)
    api.resume("hf://alice/killed", settings=api.Settings(state_dir=tmp_path / "s3"))
    assert repo_files(hub, "alice/killed") == reference

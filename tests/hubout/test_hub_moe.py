"""A mergekit-moe config into an hf:// OUT: killed after a batch commit and resumed from the repo, it ends with the
same files as the same config run into a local folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import SHARD, repo_files
from resumerge import api
from tests.moe.models import llamas, write
from tests.support import as_on_the_hub, cli


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("hub_moe")
    m = llamas(root)
    config = write(root / "moe.yml", {
        "base_model": str(m[0]), "gate_mode": "random",
        "experts": [{"source_model": str(m[1]), "noise_scale": 0.01}, {"source_model": str(m[2])}]})
    out = root / "local-out"
    api.run(config, out, settings=api.Settings(state_dir=root / "local-state", output=api.Output(out_shard_size=SHARD),
                                               merging=api.Merging(random_seed=5)))
    return config, as_on_the_hub({p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()})


def test_an_moe_run_into_the_hub_resumes_and_equals_the_local_run(hub: HubWriter, tmp_path: Path,
                                                                  moe: tuple[Path, dict[str, bytes]]) -> None:
    config, reference = moe
    state = tmp_path / "state"
    assert "mergekit_moe_config.yml" in reference and sum(n.endswith(".safetensors") for n in reference) >= 3
    killed = cli("run", config, "hf://alice/moe", "--state-dir", state, "--out-shard-size", SHARD, "--random-seed",
                 "5", "--commit-every", "2", "--quiet", env={"RESUMERGE_KILL_AT": "hub_after_commit:2"})
    assert killed.returncode == -9, killed.stderr
    assert repo_files(hub, "alice/moe") != reference
    api.resume("hf://alice/moe",
               settings=api.Settings(state_dir=state))  # never killed: in this process, an interpreter start saved
    assert repo_files(hub, "alice/moe") == reference

"""An extraction into an ``hf://`` OUT: the repo holds the bytes a local extraction writes, and a run killed
mid-adapter resumes (on a "fresh machine": state dir deleted) to the same repo."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from extract.conftest import make_finetune
from hub.fakehub_write import HubWriter

from hubout.conftest import SPEC, repo_files
from resumerge import api
from resumerge.cli.modelgen import make_model
from tests.support import cli

ADAPTER = ("adapter_model.safetensors", "adapter_config.json", "README.md")


@pytest.fixture(scope="module")
def extraction(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    """(BASE, FT, the adapter files of a local extraction at rank 4)."""
    root = tmp_path_factory.mktemp("hub-extract")
    base = make_model(root / "base", SPEC, seed=0)
    make_finetune(base, root / "ft")
    out = root / "local"
    api.extract_lora(str(root / "ft"), str(base), out, settings=api.Settings(state_dir=root / "state"),
                     lora=api.Lora(max_rank=4))
    return base, root / "ft", {name: (out / name).read_bytes() for name in ADAPTER}


def test_into_the_hub_equals_local_and_resumes_after_a_kill(hub: HubWriter, tmp_path: Path,
                                                            extraction: tuple[Path, Path, dict[str, bytes]]) -> None:
    base, ft, reference = extraction
    common = ("--model", ft, "--base-model", base, "--max-rank", "4", "-q")
    killed = cli("extract-lora", *common, "--out-path", "hf://alice/killed", "--state-dir", tmp_path / "state",
                 env={"RESUMERGE_KILL_AT": "mid_shard_write"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "adapter_model.safetensors" not in repo_files(hub, "alice/killed")
    shutil.rmtree(tmp_path / "state")  # a fresh machine: the repo's manifest is all there is
    api.resume("hf://alice/killed", settings=api.Settings(state_dir=tmp_path / "state2"))
    assert {n: repo_files(hub, "alice/killed")[n] for n in ADAPTER} == reference
    # Uninterrupted, in process: the same bytes.
    api.extract_lora(str(ft), str(base), "hf://alice/whole", settings=api.Settings(state_dir=tmp_path / "state3"),
                     lora=api.Lora(max_rank=4))
    assert {n: repo_files(hub, "alice/whole")[n] for n in ADAPTER} == reference

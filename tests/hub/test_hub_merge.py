"""Merges whose inputs come from the stand-in hub, through the real CLI code path (in-process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from huggingface_hub import constants
from support import digests, write_config

from hub.conftest import REPO, SPEC
from hub.fakehub import FakeHub
from resumerge.cli.commands import main
from resumerge.cli.modelgen import make_model


def _config(tmp_path: Path, local: Path) -> Path:
    return write_config(tmp_path / "c.yml", {
        "merge_method": "task_arithmetic", "base_model": REPO,
        "models": [{"model": REPO}, {"model": str(local), "parameters": {"weight": 0.7}}],
    })


def _served(hub: FakeHub) -> int:
    return sum(hub.file_bytes().values())


def test_hub_input_fetched_once_then_offline(tmp_path: Path, hub: FakeHub, state: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    local = make_model(tmp_path / "local", SPEC, seed=7)
    cfg = _config(tmp_path, local)
    args = ["--state-dir", str(state), "--quiet"]
    assert main(["run", str(cfg), str(tmp_path / "o1"), *args]) == 0
    first = _served(hub)
    assert first > 0
    assert not any(p.endswith((".bin", ".gguf", ".onnx", ".h5", ".msgpack")) for p in hub.file_bytes())
    manifest = json.loads((tmp_path / "o1" / "resumerge-manifest.json").read_text())
    assert re.fullmatch(f"{REPO}@[0-9a-f]{{40}}", manifest["model_dirs"][REPO])  # pinned, no cache path

    assert main(["run", str(cfg), str(tmp_path / "o2"), *args]) == 0
    assert _served(hub) == first, "a second merge must not fetch any file again"
    assert digests(tmp_path / "o1") .keys() == digests(tmp_path / "o2").keys()

    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["run", str(cfg), str(tmp_path / "o3"), *args]) == 0
    shards = {k: v for k, v in digests(tmp_path / "o1").items() if k.endswith(".safetensors")}
    assert shards == {k: v for k, v in digests(tmp_path / "o3").items() if k.endswith(".safetensors")}


def test_resume_uses_the_pinned_commit_after_the_branch_moved(tmp_path: Path, hub: FakeHub, state: Path,
                                                             models: tuple[object, ...]) -> None:
    local = make_model(tmp_path / "local", SPEC, seed=7)
    cfg = _config(tmp_path, local)
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--state-dir", str(state), "--quiet", "--out-shard-size", "10k"]) == 0
    before = digests(out)
    other = models[1]
    hub.push(REPO, other.files)  # type: ignore[attr-defined]  # main now points at another commit
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == before


def test_unknown_hub_repo_is_exit_2_before_anything_is_written(tmp_path: Path, hub: FakeHub, state: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "models": ["org/does-not-exist"]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--state-dir", str(state), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "models[0].model" in err
    assert not (tmp_path / "out").exists()


def test_a_download_leaves_huggingface_hubs_chunk_size_as_it_was(tmp_path: Path, hub: FakeHub, state: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A download reads the body in its own pieces: huggingface_hub's chunk size, one value for the whole process
    (a notebook's own downloads included), is what it was before (issue 56)."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 10 * 1024 * 1024)  # huggingface_hub's default
    cfg = _config(tmp_path, make_model(tmp_path / "local", SPEC, seed=7))
    assert main(["run", str(cfg), str(tmp_path / "out"), "--state-dir", str(state), "--quiet"]) == 0
    assert _served(hub) > 0
    assert constants.DOWNLOAD_CHUNK_SIZE == 10 * 1024 * 1024

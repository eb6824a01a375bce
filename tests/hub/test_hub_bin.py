"""Hub repos that ship only PyTorch ``.bin`` checkpoints: fetched whole (never streamed), merged like safetensors.

A repo with safetensors never has a ``.bin`` fetched (tests/hub/test_hub_merge.py); a repo without them gets the
shards its ``pytorch_model.bin.index.json`` names and nothing else (not ``training_args.bin``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import digests, write_config

from hub.conftest import SPEC
from hub.fakehub import FakeHub, files_of, iter_requests
from resumerge.cli.commands import main
from resumerge.cli.modelgen import make_model
from resumerge.inputs import torch_bin


def _bin_repo(model: Path) -> dict[str, bytes]:
    """The files of ``model`` with its weights as two interleaved ``.bin`` shards plus their index."""
    files = {k: v for k, v in files_of(model).items() if not k.endswith((".safetensors", ".safetensors.index.json"))}
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    names, weight_map = sorted(state), {}
    for k in range(2):
        file = f"pytorch_model-0000{k + 1}-of-00002.bin"
        path = model.parent / f"{model.name}-{file}"
        torch.save({n: state[n] for n in names[k::2]}, path)
        files[file] = path.read_bytes()
        weight_map.update(dict.fromkeys(names[k::2], file))
    files["pytorch_model.bin.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    files["training_args.bin"] = b"\x80\x02never fetched"
    return files


def test_a_bin_only_repo_merges_like_its_safetensors(tmp_path: Path, hub: FakeHub, state: Path) -> None:
    source = make_model(tmp_path / "src", SPEC, seed=3)
    other = make_model(tmp_path / "other", SPEC, seed=4)
    hub.push("org/binonly", _bin_repo(source))
    outs = {}
    for name, model in (("hub", "org/binonly"), ("local", str(source))):
        cfg = write_config(tmp_path / f"{name}.yml", {"merge_method": "linear", "models": [
            {"model": model, "parameters": {"weight": 0.4}}, {"model": str(other), "parameters": {"weight": 0.6}}]})
        outs[name] = tmp_path / f"out-{name}"
        args = ["--state-dir", str(state), "--quiet", "--out-shard-size", "10k", "--stream-inputs"]
        assert main(["run", str(cfg), str(outs[name]), *args]) == 0

    def weights(out: Path) -> dict[str, str]:
        return {k: v for k, v in digests(out).items() if k.endswith(".safetensors") or k == "config.json"}

    assert weights(outs["hub"]) == weights(outs["local"])
    fetched = {r.path.rsplit("/", 1)[-1] for r in iter_requests(hub) if r.path.endswith(".bin")}
    assert fetched == {"pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"}


def test_a_bin_only_repo_under_an_unsafe_unpickler_is_refused_before_its_download(
        tmp_path: Path, hub: FakeHub, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CVE-2026-24747: a torch before 2.10 has an unpickler a crafted pickle runs code through; no ``.bin`` is
    fetched to be refused after."""
    hub.push("org/binonly", _bin_repo(make_model(tmp_path / "src", SPEC, seed=3)))
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": "org/binonly", "parameters": {"weight": 0.4}},
        {"model": str(make_model(tmp_path / "other", SPEC, seed=4)), "parameters": {"weight": 0.6}}]})
    monkeypatch.setattr(torch_bin, "torch_release", lambda: (2, 9))
    assert main(["run", str(cfg), str(tmp_path / "out"), "--state-dir", str(state), "--quiet"]) == 2
    assert not [r for r in iter_requests(hub) if r.path.endswith(".bin")]

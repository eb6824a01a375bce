"""A mergekit-moe config whose base model comes from the hub: the hidden-state gates' forward pass (a process of
its own) reads the base's weights from the cache, downloaded for it, and the output equals that of the same base
given as a local folder; within --max-disk only."""

from __future__ import annotations

from pathlib import Path

import pytest

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub
from resumerge import api
from resumerge.cli.modelgen import make_model
from resumerge.errors import InputError
from tests.moe.models import tensors, write
from tests.moe.passthread import passes_on_a_thread


def _config(path: Path, base: str, experts: list[Path]) -> Path:
    return write(path, {"base_model": base, "gate_mode": "hidden", "experts": [
        {"source_model": str(experts[0]), "positive_prompts": ["ab cd"], "negative_prompts": ["ef"]},
        {"source_model": str(experts[1]), "positive_prompts": ["xy zz"]}]})


def test_hidden_gates_with_a_hub_base_equal_a_local_base(tmp_path: Path, hub: FakeHub, state: Path,
                                                         models: tuple[Model, Model]) -> None:
    local = tmp_path / "alpha"
    for name, data in models[0].files.items():
        if "/" not in name and name.endswith((".json", ".safetensors")):
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_bytes(data)
    experts = [make_model(tmp_path / f"e{i}", SPEC, seed=5 + i) for i in range(2)]
    with pytest.raises(InputError) as refused:
        api.run(_config(tmp_path / "hub.yml", REPO, experts), tmp_path / "small",
                settings=api.Settings(state_dir=state, resources=api.Resources(max_disk="10KB")))
    assert "--max-disk" in refused.value.one_line() and refused.value.yaml_path == "base_model"
    api.run(_config(tmp_path / "hub.yml", REPO, experts), tmp_path / "from-hub", settings=api.Settings(state_dir=state))
    with passes_on_a_thread():  # the reference: its pass needs no process of its own (an interpreter start saved)
        api.run(_config(tmp_path / "local.yml", str(local), experts), tmp_path / "from-folder",
                settings=api.Settings(state_dir=tmp_path / "state2"))
    ours, theirs = tensors(tmp_path / "from-hub"), tensors(tmp_path / "from-folder")
    assert sorted(ours) == sorted(theirs) and all(ours[k].equal(theirs[k]) for k in ours)
    assert ours["model.layers.1.mlp.gate.weight"].abs().sum() > 0  # routers from the pass, not zeros

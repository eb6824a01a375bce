"""A merge never written whose inputs come from the stand-in hub: planned from the headers (an unknown repo refused,
exit 2, before any download), its hub inputs downloaded once and verified as ``run`` downloads them, its tensors
the bytes ``run`` writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import write_config
from test_unwritten import _stored, _unwritten_tensors

from hub.conftest import REPO, SPEC, Model
from hub.fakehub import FakeHub
from resumerge import api
from resumerge.cli.modelgen import make_model
from resumerge.errors import InputError


def test_hub_inputs_are_downloaded_once_and_the_merge_is_the_written_one(tmp_path: Path, hub: FakeHub,
                                                                         state: Path) -> None:
    local = make_model(tmp_path / "local", SPEC, seed=7)
    config = write_config(tmp_path / "c.yml", {
        "merge_method": "task_arithmetic", "base_model": REPO,
        "models": [{"model": REPO}, {"model": str(local), "parameters": {"weight": 0.7}}]})
    with api.open_unwritten(config, settings=api.Settings(state_dir=state)) as merge:
        got = _unwritten_tensors(merge)
    served = sum(hub.file_bytes().values())
    assert served > 0
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=state))
    assert sum(hub.file_bytes().values()) == served  # run found them verified in the cache
    want = _stored(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name].contiguous().view(torch.uint8), t.view(torch.uint8)), name


def test_an_unknown_hub_repo_is_refused_before_anything_is_downloaded(tmp_path: Path, hub: FakeHub, state: Path,
                                                                       models: tuple[Model, Model]) -> None:
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": REPO, "parameters": {"weight": 0.5}}, {"model": "org/does-not-exist",
                                                         "parameters": {"weight": 0.5}}]})
    with pytest.raises(InputError, match=r"models\[1\]\.model") as refused:
        api.open_unwritten(config, settings=api.Settings(state_dir=state))
    assert refused.value.exit_code == 2
    served = hub.file_bytes()  # the headers planned from, no weight
    assert all(served.get(shard, 0) <= models[0].header_bytes(shard) for shard in models[0].shards)

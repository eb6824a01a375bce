"""An extraction whose base comes from the hub: the adapter names the hub id, never the local cache path."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hub.conftest import REPO, SPEC
from hub.fakehub import FakeHub
from resumerge.cli.commands import main
from resumerge.cli.modelgen import make_model


def test_hub_base_is_named_by_its_id(tmp_path: Path, hub: FakeHub, state: Path) -> None:
    ft = make_model(tmp_path / "ft", SPEC, seed=7)
    out = tmp_path / "adapter"
    assert main(["extract-lora", "--model", str(ft), "--base-model", REPO, "--out-path", str(out), "--max-rank", "4",
                 "--state-dir", str(state), "--quiet"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == REPO
    card = (out / "README.md").read_text()
    assert yaml.safe_load(card.split("---")[1])["base_model"] == [REPO]
    assert "snapshots" not in card and "snapshots" not in json.dumps(config)

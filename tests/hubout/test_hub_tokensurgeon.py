"""A transplant from and into the hub, as merges read and write it: MODEL and DONOR hub repos read by HTTP Range
(``--stream-inputs``) and an ``hf://`` OUT hold the bytes a local transplant of the same folders writes."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter
from transplant.pairs import make_pair

from hubout.conftest import repo_files
from resumerge import api

# What a transplant's output holds that names no input by where it was read from.
_WEIGHTS = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    """(MODEL, DONOR, the files of their local transplant)."""
    root = tmp_path_factory.mktemp("ts-pair")
    model, donor = make_pair(root)
    out = root / "local"
    api.tokensurgeon(str(model), str(donor), out, surgery=api.Surgery(k=8), settings=api.Settings(state_dir=root / "s"))
    return model, donor, {name: (out / name).read_bytes() for name in _WEIGHTS}


def _push(hub: HubWriter, repo: str, folder: Path) -> None:
    hub.hub.push(repo, {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()})


def test_hub_inputs_read_by_range_into_an_hf_out_equal_a_local_transplant(
        hub: HubWriter, tmp_path: Path, pair: tuple[Path, Path, dict[str, bytes]]) -> None:
    model, donor, reference = pair
    _push(hub, "team/model", model)
    _push(hub, "team/donor", donor)
    api.tokensurgeon("team/model", "team/donor", "hf://alice/transplanted", surgery=api.Surgery(k=8),
                     settings=api.Settings(resources=api.Resources(stream_inputs=True), state_dir=tmp_path / "s"))
    written = repo_files(hub, "alice/transplanted")
    assert {name: written[name] for name in _WEIGHTS} == reference
    ranged = [r for r in hub.hub.requests if r.method == "GET" and r.path.startswith("/team/")
              and r.path.endswith(".safetensors")]
    assert ranged and all(r.range for r in ranged), "a weight file was downloaded whole"
    card = written["README.md"].decode()
    assert "team/model" in card and "team/donor" in card and "snapshots" not in card

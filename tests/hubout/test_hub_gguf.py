"""A GGUF output (``--out-type gguf``, one file or gguf-split's files) to an ``hf://`` OUT: the repo holds the bytes
a local run writes, each split file its own upload."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub.fakehub_write import HubWriter

from hubout.conftest import TIERS, repo_files
from resumerge import api
from tests.ggufmodels import Q, hf_tensors, to_gguf, write_gguf
from tests.support import write_config


@pytest.mark.parametrize("tier", TIERS, indirect=True)
@pytest.mark.parametrize("split", [None, 40_000])
def test_a_gguf_output_to_the_hub_equals_a_local_run(hub: HubWriter, tmp_path: Path, split: int | None) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, "llama", to_gguf("llama", hf_tensors("llama", seed=1)), Q.F32)
    write_gguf(b, "llama", to_gguf("llama", hf_tensors("llama", seed=2)), Q.F32)
    config = write_config(tmp_path / "c.yml", {"merge_method": "linear", "dtype": "float32", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    # the shard size as a local run's default (a GGUF output does not use it; the hub's default is sized otherwise)
    output = api.Output(out_shard_size="1GB", out_type="gguf", gguf_type="q8_0", gguf_split_max_size=split)
    local = tmp_path / "local"
    api.run(config, local, state_dir=tmp_path / "s0", output=output)
    reference = {p.name: p.read_bytes() for p in sorted(local.iterdir()) if p.is_file()}
    assert sum(n.endswith(".gguf") for n in reference) == (1 if split is None else 15)
    api.run(config, "hf://alice/gguf", state_dir=tmp_path / "s1", output=output)
    assert repo_files(hub, "alice/gguf") == reference

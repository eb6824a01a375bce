"""Output shards named like the base (or first) model's: DeepSeek-V3's 5-and-6-digit numbers, transformers' 5-digit
ones, Kimi-K2's unpadded ones, and transformers' naming after a single-file parent; the index names them and their
total size. A run recorded before outputs followed their parents keeps today's names and fingerprint."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from sparse_checkpoints import DEEPSEEK_V3, write_sparse_checkpoint
from support import linear_config, write_config

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.inputs.safetensors_format import read_header
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.merge_plan import PlanOptions, fingerprint_parts
from resumerge.merge.plan.sharding import ShardNaming, parent_naming

TINY = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)


def test_the_numbering_is_read_from_the_parent_s_first_shard() -> None:
    deepseek = [f"model-{i:05d}-of-000163.safetensors" for i in (2, 1, 163)]
    assert parent_naming(deepseek) == ShardNaming("model-", 5, 6)
    assert parent_naming(["model-00001-of-00004.safetensors"]) == ShardNaming()
    assert parent_naming(["model-1-of-61.safetensors", "model-10-of-61.safetensors"]) == ShardNaming("model-", 1, 1)
    for other in (["model.safetensors"], ["pytorch_model-00001-of-00002.bin"],
                  ["sub/model-00001-of-00002.safetensors"]):
        assert parent_naming(other) == ShardNaming()
    assert ShardNaming("model-", 5, 6).names(3) == [f"model-{i:05d}-of-000003.safetensors" for i in (1, 2, 3)]
    assert ShardNaming("model-", 1, 1).names(12)[-1] == "model-12-of-12.safetensors"
    assert ShardNaming("model-", 5, 6).names(1) == ["model.safetensors"]  # one file: as transformers names it


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3's real headers over holes (one dense layer, no MTP), its own naming in 3 shards."""
    return write_sparse_checkpoint(tmp_path_factory.mktemp("ds") / "v3", DEEPSEEK_V3, layers=1, mtp=False, shards=3)


def test_a_deepseek_parent_s_six_digit_count_is_kept_and_a_recorded_run_keeps_today_s_names(
        deepseek: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "m.yml", linear_config(deepseek, deepseek))
    plan = api.plan_merge(config, settings=api.Settings(output=api.Output(out_shard_size="1GB")))
    count = len(plan.shards)
    assert count > 2 and [s.name for s in plan.shards] == [f"model-{i:05d}-of-{count:06d}.safetensors"
                                                          for i in range(1, count + 1)]
    # Options recorded before the field existed load as its default: today's names, today's options hash.
    recorded = plan_from_config(load_config_text(config.read_text()), PlanOptions(out_shard_size=1_000_000_000))
    assert [s.name for s in recorded.shards] == [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                 for i in range(1, count + 1)]
    old = replace(recorded, options=replace(recorded.options, parent_shard_names=False))
    assert fingerprint_parts(old)["options"] == fingerprint_parts(replace(old, options=PlanOptions(
        out_shard_size=1_000_000_000)))["options"]
    assert fingerprint_parts(plan)["options"] != fingerprint_parts(recorded)["options"]


def _renamed(model: Path, pattern: str) -> Path:
    """``model``'s shards renamed by ``pattern`` (formatted with index= and total=), its index rewritten."""
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    old = sorted(set(index["weight_map"].values()))
    new = {name: pattern.format(index=i, total=len(old)) for i, name in enumerate(old, 1)}
    for name in old:
        (model / name).rename(model / new[name])
    index["weight_map"] = {k: new[v] for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return model


SIX = "model-{index:05d}-of-{total:06d}.safetensors"


@pytest.mark.parametrize(("pattern", "expected"), [
    (SIX, "model-{i:05d}-of-{n:06d}.safetensors"),
    ("model-{index:05d}-of-{total:05d}.safetensors", "model-{i:05d}-of-{n:05d}.safetensors"),
    ("model-{index}-of-{total}.safetensors", "model-{i}-of-{n}.safetensors"),
    (None, "model-{i:05d}-of-{n:05d}.safetensors"),  # a single-file parent: transformers' naming
])
def test_a_plan_names_its_shards_like_its_parent(tmp_path: Path, pattern: str | None, expected: str) -> None:
    a, b = _pair(tmp_path, pattern)
    plan = api.plan_merge(write_config(tmp_path / "m.yml", linear_config(a, b)),
                          settings=api.Settings(output=api.Output(out_shard_size="15k")))
    names = [s.name for s in plan.shards]
    assert len(names) > 2 and names == [expected.format(i=i, n=len(names)) for i in range(1, len(names) + 1)]


def test_a_run_writes_the_parent_s_names_and_an_index_of_them(tmp_path: Path) -> None:
    a, b = _pair(tmp_path, SIX)
    out = tmp_path / "out"
    api.run(write_config(tmp_path / "m.yml", linear_config(a, b)), out,
            settings=api.Settings(state_dir=tmp_path / "state", output=api.Output(out_shard_size="15k")))
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards == [SIX.format(index=i, total=len(shards)) for i in range(1, len(shards) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    sizes = 0
    for shard in shards:
        header = read_header(out / shard)
        assert {k for k, v in index["weight_map"].items() if v == shard} == set(header.tensors)
        sizes += sum(t.end - t.start for t in header.tensors.values())
    assert index["metadata"]["total_size"] == sizes


def _pair(tmp_path: Path, pattern: str | None) -> tuple[Path, Path]:
    """Two tiny models whose first's shards are named by ``pattern`` (one file when None)."""
    spec = replace(TINY, shard_bytes=10**9 if pattern is None else 20_000)
    a, b = (make_model(tmp_path / name, spec, seed=seed) for name, seed in (("a", 1), ("b", 2)))
    if pattern is None:
        assert [p.name for p in a.glob("*.safetensors")] == ["model.safetensors"]
        return a, b
    return _renamed(a, pattern), b

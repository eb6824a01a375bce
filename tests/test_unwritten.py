"""A merge never written (:func:`resumerge.api.open_unwritten`): each stored tensor read from it is, byte for byte,
what ``run`` writes for the same config (linear, TIES, SLERP, a recipe's final stage over an earlier stage, MoE
inputs, block-FP8 inputs kept in their format), and the forward engine's figures over it equal those over the
written output; a config that does not plan is refused before a weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import ModelFactory
from quantmodels import fp8, fp8_config, quantize_model
from safetensors.torch import load_file
from textnll import stream_nlls

from resumerge import api
from resumerge.analyses.check.models import open_checked
from resumerge.config.locations import StateDir
from resumerge.errors import ConfigError, InputError, UsageError
from resumerge.forward.engine.reader import Weights
from resumerge.merge.engine.unwritten import UnwrittenMerge

SPEC = {"layers": 2, "hidden": 40, "intermediate": 56, "shard_bytes": 20_000}
TEXTS = [[1, 5, 9, 3, 7, 2, 11, 4], [6, 2, 8, 8, 1, 30, 12], [3, 3, 14, 2, 9]]


def _models(make: ModelFactory, count: int = 3) -> list[Path]:
    return [make(name, seed=seed, **SPEC) for seed, name in enumerate(("base", "a", "b")[:count], start=1)]


def _config(path: Path, doc: dict[str, object] | list[dict[str, object]]) -> Path:
    docs = doc if isinstance(doc, list) else [doc]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _unwritten_tensors(merge: UnwrittenMerge) -> dict[str, torch.Tensor]:
    """Every stored tensor of ``merge``, read as a reader of its files reads it."""
    return {name: merge.source.read_tensor(t.file, t.entry.start, t.entry.end, t.entry.dtype, tuple(t.entry.shape))
            for name, t in merge.tensors.items()}


def _same_as_written(tmp_path: Path, config: Path, resources: api.Resources | None = None) -> UnwrittenMerge:
    """Run ``config`` into OUT, open it unwritten (with ``resources``), and check every stored tensor byte for byte;
    the merge, open."""
    state = tmp_path / "state"
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(state_dir=state))
    written = _stored(out)
    merge = api.open_unwritten(config, settings=api.Settings(state_dir=state, resources=resources or api.Resources()))
    got = _unwritten_tensors(merge)
    assert sorted(got) == sorted(written)
    for name, want in written.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].contiguous().view(torch.uint8), want.view(torch.uint8)), name
    assert (merge.directory / "config.json").read_bytes() == (out / "config.json").read_bytes()
    assert not list(merge.directory.glob("*.safetensors"))
    return merge


def _same_figures(tmp_path: Path, merge: UnwrittenMerge) -> None:
    out = open_checked(str(tmp_path / "out"), "MODEL", StateDir.resolve(tmp_path / "state"))
    written = stream_nlls(Weights.of(out.opened.directory, out.opened.tensors), out.opened.config, TEXTS)
    unwritten = stream_nlls(Weights.of(merge.directory, merge.tensors, source=merge.source), merge.config, TEXTS)
    assert written == pytest.approx(unwritten, abs=1e-6, rel=0)
    assert all(f > 0 for f in written)


def test_linear_unwritten_is_the_written_merge_and_runs_the_same(tmp_path: Path, make: ModelFactory) -> None:
    _, a, b = _models(make)
    config = _config(tmp_path / "linear.yml", {"merge_method": "linear", "dtype": "bfloat16", "models": [
        {"model": str(a), "parameters": {"weight": 0.3}}, {"model": str(b), "parameters": {"weight": 0.7}}]})
    with _same_as_written(tmp_path, config) as merge:
        _same_figures(tmp_path, merge)
        assert merge.source.computed >= len(merge.plan.tensors)
        # As an input source: any byte range inside a stored tensor is the written file's bytes there.
        for t in list(merge.tensors.values())[:5]:
            written = (tmp_path / "out" / t.file).read_bytes()
            for start, end in ((t.entry.start, t.entry.end), (t.entry.start + 3, t.entry.end - 5)):
                assert bytes(merge.source.read_range(t.file, start, end).numpy()) == written[start:end]


def test_ties_and_slerp_unwritten_are_the_written_merges(tmp_path: Path, make: ModelFactory) -> None:
    base, a, b = _models(make)
    ties = _config(tmp_path / "ties.yml", {"merge_method": "ties", "base_model": str(base), "models": [
        {"model": str(a), "parameters": {"weight": 0.6, "density": 0.5}},
        {"model": str(b), "parameters": {"weight": 0.4, "density": 0.7}}], "parameters": {"normalize": True}})
    with _same_as_written(tmp_path / "ties", ties):
        pass
    slerp = _config(tmp_path / "slerp.yml", {"merge_method": "slerp", "base_model": str(base), "models": [
        {"model": str(base)}, {"model": str(a)}], "parameters": {"t": [0.1, 0.6, 0.9]}})
    with _same_as_written(tmp_path / "slerp", slerp, api.Resources(max_memory="4GB")) as merge:  # its own governor
        _same_figures(tmp_path / "slerp", merge)


def test_a_recipes_final_stage_is_read_through_its_earlier_stage_unwritten(tmp_path: Path,
                                                                           make: ModelFactory) -> None:
    base, a, b = _models(make)
    recipe = _config(tmp_path / "recipe.yml", [
        {"name": "first", "merge_method": "linear", "models": [
            {"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]},
        {"merge_method": "slerp", "base_model": str(base), "models": [{"model": str(base)}, {"model": "first"}],
         "parameters": {"t": 0.4}}])
    with _same_as_written(tmp_path, recipe) as merge:
        _same_figures(tmp_path, merge)


def test_moe_inputs_unwritten_are_the_written_merge(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from families import FAMILIES, make_family_model

    mixtral = next(f for f in FAMILIES if f.name == "mixtral")
    a = make_family_model(tmp_path / "a", mixtral, 1)
    b = make_family_model(tmp_path / "b", mixtral, 2)
    config = _config(tmp_path / "moe.yml", {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 0.25}}, {"model": str(b), "parameters": {"weight": 0.75}}]})
    with _same_as_written(tmp_path, config) as merge:
        _same_figures(tmp_path, merge)


def test_block_fp8_inputs_kept_in_their_format_unwritten_are_the_written_merge(tmp_path: Path,
                                                                               make: ModelFactory) -> None:
    models = []
    for name, seed in (("a", 1), ("b", 2)):
        directory = make(name, seed=seed, **SPEC)
        quantize_model(directory, tmp_path / f"{name}-decoded", fp8((16, 16)), fp8_config((16, 16)))
        models.append(directory)
    config = _config(tmp_path / "fp8.yml", {"merge_method": "linear", "models": [
        {"model": str(m), "parameters": {"weight": w}} for m, w in zip(models, (0.4, 0.6), strict=True)]})
    with _same_as_written(tmp_path, config) as merge:
        assert any(name.endswith("_scale_inv") for name in merge.tensors)  # kept in the base's format
        _same_figures(tmp_path, merge)


def test_a_config_that_does_not_plan_is_refused_before_a_weight_is_read(tmp_path: Path,
                                                                        make: ModelFactory) -> None:
    _, a = _models(make, 2)
    bad = _config(tmp_path / "bad.yml", {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": 1.0}}, {"model": str(tmp_path / "missing")}]})
    with pytest.raises(InputError, match="no such directory") as missing:
        api.open_unwritten(bad, settings=api.Settings(state_dir=tmp_path / "state"))
    assert missing.value.exit_code == 2
    unknown = _config(tmp_path / "unknown.yml", {"merge_method": "lineal", "models": [{"model": str(a)}]})
    with pytest.raises(ConfigError, match="lineal"):
        api.open_unwritten(unknown, settings=api.Settings(state_dir=tmp_path / "state"))
    with pytest.raises(UsageError, match="safetensors"):
        api.open_unwritten(bad, settings=api.Settings(state_dir=tmp_path / "state", output=api.Output(out_type="gguf")))
    moe = _config(tmp_path / "moe.yml", {"base_model": str(a), "gate_mode": "random", "experts": [
        {"source_model": str(a), "positive_prompts": ["x"]}]})
    with pytest.raises(UsageError, match="mergekit-moe"):
        api.open_unwritten(moe, settings=api.Settings(state_dir=tmp_path / "state"))


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_under_a_small_budget_tensors_are_merged_in_row_chunks_into_the_same_bytes(tmp_path: Path, make: ModelFactory,
                                                                                  method: str) -> None:
    from resumerge.machine.memory import FakeProbe, MemoryGovernor

    # Projections whose merge is larger than the least row chunk the engine cuts (plan.workunits.MIN_CHUNK_BYTES).
    wide = {**SPEC, "layers": 1, "hidden": 512, "intermediate": 1536, "shard_bytes": 8 << 20}
    base, a, b = (make(name, seed=seed, **wide) for seed, name in enumerate(("base", "a", "b"), start=1))
    doc: dict[str, object] = {"merge_method": method, "models": [
        {"model": str(a), "parameters": {"weight": 0.6, "density": 0.5}},
        {"model": str(b), "parameters": {"weight": 0.4, "density": 0.7}}]}
    config = _config(tmp_path / f"{method}.yml", {**doc, "base_model": str(base)} if method == "ties" else doc)
    api.run(config, tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "state"))
    written = _stored(tmp_path / "out")
    # A quarter of it is below a projection's merge: those are merged, as run merges them, a few rows at a time.
    governor = MemoryGovernor(24 << 20, FakeProbe())
    with api.open_unwritten(config, settings=api.Settings(state_dir=tmp_path / "state"), governor=governor) as merge:
        got = _unwritten_tensors(merge)
        assert governor.admitted > merge.source.computed  # more admissions than tensors: row chunks
    for name, want in written.items():
        assert torch.equal(got[name].contiguous().view(torch.uint8), want.view(torch.uint8)), name

"""The SVD methods (``tsv``, ``iso_c``, ``iso_cts``) end to end through the CLI: a tiny model merged, killed after
its second shard's commit and resumed byte-identical to an uninterrupted run; the written matrices are the
method's function of the inputs; ``plan`` says the time is SVD-bound; the card names the paper."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from support import cli, digests, output_tensors, write_config

from resumerge.cli.commands import main
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.merge.methods import MergeContext, get_method

SHARD = "40k"
WEIGHT = "model.layers.1.mlp.down_proj.weight"
NORM = "model.layers.1.input_layernorm.weight"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
PARAMS: dict[str, dict[str, Any]] = {"tsv": {"scaling": 0.9}, "iso_c": {"scaling": 1.3},
                                     "iso_cts": {"scaling": 1.1, "common_space_fraction": 0.6}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("svd")
    spec = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64, shard_bytes=20_000)
    for name, seed in (("base", 0), ("a", 1), ("b", 2), ("c", 3)):
        make_model(root / name, spec, seed=seed)
    return root


def _config(root: Path, method: str) -> Path:
    return write_config(root / f"{method}.yml", {
        "merge_method": method, "base_model": str(root / "base"), "parameters": PARAMS[method],
        "models": [{"model": str(root / name)} for name in ("a", "b", "c")]})


def _inputs(root: Path, name: str) -> list[torch.Tensor]:
    return [output_tensors(root / model)[name] for model in ("base", "a", "b", "c")]


@pytest.mark.parametrize("method", ["tsv", "iso_c", "iso_cts"])
def test_killed_merge_resumes_byte_identical(models: Path, method: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(models, method)
    reference, ref_state = models / f"{method}-reference", models / f"{method}-ref-state"
    assert main(["run", str(config), str(reference), "--state-dir", str(ref_state), "--out-shard-size", SHARD,
                 "--quiet"]) == 0
    out, state = models / f"{method}-out", models / f"{method}-state"
    killed = cli("run", config, out, "--state-dir", state, "--out-shard-size", SHARD, "--quiet",
                 env={"RESUMERGE_KILL_AT": "after_ledger_commit:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert main(["resume", str(out), "--state-dir", str(state), "--quiet"]) == 0
    assert digests(out) == digests(reference)
    assert len(list(reference.glob("*.safetensors"))) > 2  # the kill fell between shards

    written = output_tensors(reference)
    spec = get_method(method)
    assert spec is not None
    # A linear weight decomposed, a norm and (by the planner's vocabulary default) the embedding and head averaged.
    for name, svd in ((WEIGHT, True), (NORM, True), (EMBED, False), (HEAD, False)):
        tensors = _inputs(models, name)
        per_model, params = spec.bind([{}] * 4, PARAMS[method] | {"svd": svd}, 0)
        want = spec.fn(MergeContext(tensors, 0, per_model, params)).to(tensors[0].dtype)
        assert torch.equal(written[name], want), name
    mean = _inputs(models, HEAD)[0].double() + PARAMS[method]["scaling"] * torch.stack(
        [t.double() - _inputs(models, HEAD)[0].double() for t in _inputs(models, HEAD)[1:]]).mean(0)
    assert torch.allclose(written[HEAD].double(), mean, rtol=0, atol=1e-6)
    card = (reference / "README.md").read_text()
    assert spec.title in card and spec.reference in card

    capsys.readouterr()
    assert main(["plan", str(config), str(models / f"{method}-planned")]) == 0
    assert "SVD-bound" in capsys.readouterr().out


def test_the_vocabulary_is_decomposed_only_when_asked(models: Path) -> None:
    from resumerge import api
    from resumerge.merge.plan.workunits import estimate_bytes

    def svd_of(parameters: dict[str, Any]) -> dict[str, bool]:
        doc: dict[str, object] = {"merge_method": "tsv", "base_model": str(models / "base"),
                                  "parameters": parameters,
                                  "models": [{"model": str(models / "a")}, {"model": str(models / "b")}]}
        plan = api.plan_merge(write_config(models / "vocab.yml", doc))
        assert spec is not None
        reserved[parameters.get("svd") is True] = estimate_bytes(plan.tensors[HEAD], spec, threads=1)
        return {name: dict(plan.tensors[name].params)["svd"] for name in (WEIGHT, EMBED, HEAD)}

    spec = get_method("tsv")
    reserved: dict[bool, int] = {}
    assert svd_of({}) == {WEIGHT: True, EMBED: False, HEAD: False}
    assert svd_of({"svd": True}) == {WEIGHT: True, EMBED: True, HEAD: True}
    # An averaged head is sized as the mean path it takes, a decomposed one as its SVDs.
    assert reserved[False] < reserved[True]
    assert svd_of({"svd": [{"filter": "embed_tokens", "value": True}, {"value": False}]}) == {
        WEIGHT: False, EMBED: True, HEAD: False}

"""RegMean++ (``regmean_plus``): ``resumerge measure`` of its config measures each layer on the merged model's earlier
layers, and the merge solves on those Grams. The identities of ``methods-2025.md`` §8: with one layer and identical
embeddings RegMean++'s Grams are RegMean's; in a two-layer model, layer 1's Gram is the Gram of the merged layer 0's
outputs through each model's own layer 1 (checked on transformers' own forward of the merged model with that
model's layer 1). Grams of the other pass, or of another ratio, are refused; a killed merged pass resumes
byte-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import cli, cli_here, digests, write_config

from resumerge import api
from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.errors import ConfigError
from resumerge.inputs.grams import MANIFEST, read_measurement

pytest.importorskip("transformers")

TEXTS = "The capital of France is Paris.\ndef square(x): return x * x\n"


def _config(root: Path, name: str, method: str, models: list[Path], grams: Path, ratio: float = 0.5) -> Path:
    return write_config(root / f"{name}.yml", {
        "merge_method": method, "models": [{"model": str(m)} for m in models],
        "parameters": {"grams": str(grams), "reduce_non_diagonal_ratio": ratio}, "dtype": "float32"})


def _grams(folder: Path, index: int, layer: int) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"model-{index:02d}" / f"layer-{layer:05d}.safetensors"))


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plus")
    spec = ModelSpec(layers=2, hidden=32, intermediate=48, vocab=64)
    a, b = make_model(root / "a", spec, seed=11), make_model(root / "b", spec, seed=12)
    (root / "texts.txt").write_text(TEXTS)
    config = _config(root, "plus", "regmean_plus", [a, b], root / "gplus")
    # a fresh process, as the killed and resumed measurements compared with it (bytes of matrix products)
    done = cli("measure", config, root / "gplus", "--texts", root / "texts.txt")
    assert done.returncode == 0 and "merged pass" in done.stderr, done.stderr
    return {"root": root, "a": a, "b": b, "config": config, "grams": root / "gplus", "texts": root / "texts.txt"}


def test_one_layer_with_identical_embeddings_gives_regmeans_grams(tmp_path: Path) -> None:
    spec = ModelSpec(layers=1, hidden=32, intermediate=48, vocab=64)
    a, b = make_model(tmp_path / "a", spec, seed=1), make_model(tmp_path / "b", spec, seed=2)
    embedding = "model.embed_tokens.weight"
    mine = next(f for f in a.glob("*.safetensors") if embedding in load_file(str(f)))
    theirs = next(f for f in b.glob("*.safetensors") if embedding in load_file(str(f)))
    shard = load_file(str(theirs))
    shard[embedding] = load_file(str(mine))[embedding]
    save_file(shard, str(theirs), metadata={"format": "pt"})
    (tmp_path / "texts.txt").write_text(TEXTS)
    plain = _config(tmp_path, "plain", "regmean", [a, b], tmp_path / "g")
    plus = _config(tmp_path, "plus", "regmean_plus", [a, b], tmp_path / "gp")
    api.measure(plain, tmp_path / "g", texts=tmp_path / "texts.txt")
    api.measure(plus, tmp_path / "gp", texts=tmp_path / "texts.txt")
    for index in (0, 1):
        want, got = _grams(tmp_path / "g", index, 0), _grams(tmp_path / "gp", index, 0)
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    assert read_measurement(tmp_path / "gp").merged == {"method": "regmean_plus", "reduce_non_diagonal_ratio": 0.5}


def test_layer_one_grams_are_those_of_the_merged_layer_zero_through_each_models_layer_one(
        two_layers: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from resumerge.forward.text.texts import sequences

    out = tmp_path / "out"
    done = cli_here("run", two_layers["config"], out, "--state-dir", tmp_path / "state", "-q")
    assert done.returncode == 0, done.stderr
    tokens = sequences(AutoTokenizer.from_pretrained(str(two_layers["a"])), two_layers["texts"])
    for index, model in enumerate((two_layers["a"], two_layers["b"])):
        hybrid = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        own = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        hybrid.model.layers[1].load_state_dict(own.model.layers[1].state_dict())
        sums: dict[str, torch.Tensor] = {}

        def hook(name: str, sums: dict[str, torch.Tensor] = sums):  # type: ignore[no-untyped-def]
            def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.T @ x  # type: ignore[operator]
            return record

        layer = hybrid.model.layers[1]
        layer.self_attn.q_proj.register_forward_pre_hook(hook("q"))
        layer.mlp.down_proj.register_forward_pre_hook(hook("down"))
        with torch.no_grad():
            for ids in tokens:
                hybrid(torch.tensor([ids]))
        count = sum(len(t) for t in tokens)
        stored = _grams(two_layers["grams"], index, 1)
        torch.testing.assert_close(stored["model.layers.1.self_attn.q_proj"], (sums["q"] / count).float(),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stored["model.layers.1.mlp.down_proj"], (sums["down"] / count).float(),
                                   rtol=1e-4, atol=1e-5)


def test_grams_of_the_other_pass_or_another_ratio_are_refused(two_layers: dict[str, Path], tmp_path: Path) -> None:
    a, b = two_layers["a"], two_layers["b"]
    with pytest.raises(ConfigError, match="RegMean\\+\\+ Grams"):
        api.plan_merge(_config(tmp_path, "plain", "regmean", [a, b], two_layers["grams"]))
    with pytest.raises(ConfigError, match=r"at reduce_non_diagonal_ratio 0\.3"):
        api.plan_merge(_config(tmp_path, "ratio", "regmean_plus", [a, b], two_layers["grams"], ratio=0.3))
    with pytest.raises(ConfigError, match="merge of 2 models"):
        api.plan_merge(_config(tmp_path, "one", "regmean_plus", [a], two_layers["grams"]))


@pytest.mark.slow
def test_a_killed_merged_pass_resumes_byte_identical(two_layers: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "gplus"
    args = ("measure", two_layers["config"], out, "--texts", two_layers["texts"])
    killed = cli(*args, env={"RESUMERGE_KILL_AT": "after_measure_layer:1"})
    assert killed.returncode == -9, killed.stderr
    assert not (out / MANIFEST).exists() and api.status(out).tensors_done == 2  # layer 0 of both models
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("measuring:") == 1 and "layer 2 of 2" in resumed.stderr
    for folder in ("", "model-00", "model-01"):
        assert digests(out / folder) == digests(two_layers["grams"] / folder), folder
    assert json.loads((out / MANIFEST).read_text())["merged"]["method"] == "regmean_plus"

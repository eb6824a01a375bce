"""A MoE output architecture is one record: the choice, the planner and the config writer read
:class:`~resumerge.runs.moe.outkinds.OutputKind` and never name an architecture, so a record added here (passed in, no
module state touched) plans like a built-in one."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
import yaml

from resumerge import api
from resumerge.errors import ConfigError
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.runs.moe import architectures, load_moe_text, outconfig, outkinds, planner
from resumerge.runs.moe.architectures import choose_output
from resumerge.runs.moe.outkinds import ATTENTION, OUTPUT_KINDS, ConfigPatch, OutputKind, no_shared, one_gated
from resumerge.runs.moe.planner import build_moe_plan
from tests.moe.models import llamas, write

TOY = OutputKind(name="Toy MoE", source_types=("llama",), shared_rule=one_gated, kept=ATTENTION, fused=False,
                 shared_module="toy_shared", shared_gate=True,
                 config=ConfigPatch(architecture="ToyMoeForCausalLM", model_type="toy_moe",
                                    experts_key="num_toy_experts", shared_key="num_toy_shared",
                                    intermediate_keys=("toy_intermediate_size",),
                                    fixed=MappingProxyType({"toy_layers": [0]}),
                                    defaults=MappingProxyType({"hidden_act": "toy"})))


def test_the_records_are_mergekit_moes_candidates_in_its_order_then_resumerges() -> None:
    assert [k.name for k in OUTPUT_KINDS] == ["Mixtral", "DeepSeek MoE", "Qwen MoE", "Qwen3 MoE", "GLM-4 MoE"]
    assert [k.name for k in OUTPUT_KINDS if k.preferred] == ["Mixtral"]
    assert len({k.config.architecture for k in OUTPUT_KINDS}) == len(OUTPUT_KINDS)
    for kind in OUTPUT_KINDS:  # a kind that takes a shared expert says where it goes
        assert (kind.shared_rule is no_shared) == (kind.shared_module is None), kind.name
        assert set(kind.zero_filled) <= set(kind.kept) and set(kind.required()) <= set(kind.kept)


def _names(kind: OutputKind) -> set[str]:
    return {kind.name, kind.config.architecture, kind.config.model_type}


@pytest.mark.parametrize("module", [architectures, planner, outconfig])
def test_no_architecture_is_named_outside_the_records(module: Any) -> None:
    tree = ast.parse(Path(module.__file__).read_text())
    named = {n for kind in OUTPUT_KINDS for n in _names(kind)}
    records = {name for name, value in vars(outkinds).items() if isinstance(value, OutputKind)}
    assert records == {"MIXTRAL", "DEEPSEEK", "QWEN2", "QWEN3", "GLM4_MOE"}  # the check below looks for these names
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert not any(n.lower() in node.value.lower() for n in named), node.value
        if isinstance(node, ast.Name | ast.alias):
            assert (node.id if isinstance(node, ast.Name) else node.name) not in records, ast.dump(node)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInput]:
    paths = llamas(tmp_path_factory.mktemp("outkinds"))
    doc = write(paths[0].parent / "moe.yml", _doc(paths, "mixtral"))
    return dict(open_inputs(load_moe_text(doc.read_text()).as_merge_config()).models)


def _doc(paths: list[Path], architecture: str) -> dict[str, Any]:
    return {"base_model": str(paths[0]), "gate_mode": "random", "architecture": architecture,
            "experts": [{"source_model": str(paths[1])}, {"source_model": str(paths[2])}],
            "shared_experts": [{"source_model": str(paths[0])}]}


def _plan(models: dict[str, ModelInput], architecture: str, kinds: tuple[OutputKind, ...]) -> Plan:
    paths = sorted(Path(m.directory) for m in models.values())
    config = load_moe_text(write(paths[0].parent / "moe.yml", _doc(paths, architecture)).read_text())
    return build_moe_plan(config, models, PlanOptions(), kinds=kinds)


def test_a_record_added_in_a_test_plans_like_a_built_in_kind(models: dict[str, ModelInput]) -> None:
    with pytest.raises(ConfigError) as caught:  # not a candidate unless passed in
        _plan(models, "toy", OUTPUT_KINDS)
    assert "Mixtral, DeepSeek MoE, Qwen MoE, Qwen3 MoE, GLM-4 MoE" in caught.value.one_line()
    plan = _plan(models, "toy", (*OUTPUT_KINDS, TOY))
    layer = "model.layers.1.mlp"
    expected = {f"{layer}.experts.{e}.{p}.weight" for e in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")}
    expected |= {f"{layer}.toy_shared.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    expected |= {f"{layer}.gate.weight", f"{layer}.shared_expert_gate.weight"}
    assert {n for n in plan.tensors if n.startswith(layer + ".")} == expected
    assert plan.tensors[f"{layer}.shared_expert_gate.weight"].shape == (1, 32)
    assert "model.layers.1.self_attn.q_proj.bias" not in plan.tensors  # nothing zero-filled
    cfg = plan.out_config
    assert (cfg["architectures"], cfg["model_type"], cfg["num_toy_experts"], cfg["num_toy_shared"]) == (
        ["ToyMoeForCausalLM"], "toy_moe", 2, 1)
    assert cfg["toy_intermediate_size"] == cfg["intermediate_size"] and cfg["toy_layers"] == [0]
    assert cfg["hidden_act"] == "silu"  # a default yields to the base's value
    assert TOY.config.fixed["toy_layers"] == [0]  # the record is copied, never written through


def test_the_choice_reads_the_records_rules(models: dict[str, ModelInput]) -> None:
    paths = sorted(Path(m.directory) for m in models.values())
    doc = _doc(paths, "x")
    del doc["architecture"], doc["shared_experts"]
    config = load_moe_text(write(paths[0].parent / "plain.yml", doc).read_text())
    ungated = dataclasses.replace(TOY, shared_rule=no_shared)
    assert choose_output(config, models, (ungated, *OUTPUT_KINDS)).kind.name == "Mixtral"  # preferred wins
    first = choose_output(config, models, (ungated, *OUTPUT_KINDS[1:]))
    assert first.kind is ungated and "defaulting to Toy MoE" in first.notes[0]
    with pytest.raises(ConfigError) as caught:
        choose_output(config, models, (TOY,))
    assert "Toy MoE: it needs exactly one shared expert" in caught.value.one_line()


def test_a_glm4_moe_output_loads_and_is_its_experts_mixture(models: dict[str, ModelInput], tmp_path: Path) -> None:
    """GLM-4-MoE, resumerge's own kind (mergekit-moe has none), chosen by name: with every routed expert and the
    shared one the base's MLP, each layer's MoE is twice that MLP whatever the routers (renormalised, unscaled
    weights), so the output computes the base with its ``down_proj`` doubled — rotary, norms and routing as
    transformers 5 reads the config."""
    transformers = pytest.importorskip("transformers")
    base = next(Path(m.directory) for m in models.values() if Path(m.directory).name == "m0")
    doc = {**_doc([base, base, base], "glm"), "experts_per_token": 2}
    out = tmp_path / "out"
    api.run(yaml.safe_dump(doc), out, settings=api.Settings(state_dir=tmp_path / "state",
                                                            merging=api.Merging(allow_same_experts=True)))
    moe, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    assert type(moe).__name__ == "Glm4MoeForCausalLM" and moe.config.n_shared_experts == 1
    llama = transformers.AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for layer in llama.model.layers:
            layer.mlp.down_proj.weight.mul_(2)
        tokens = torch.tensor([[1, 5, 9, 2, 33, 63]])
        torch.testing.assert_close(moe(tokens).logits, llama(tokens).logits, rtol=1e-4, atol=1e-5)

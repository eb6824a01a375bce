"""MoE upcycling from quantized models: the base's and the experts' tensors are decoded through the run's codecs
before they are copied or fused, so the experts are those of the decoded (dequantized) models; the hidden-state
gate modes' forward pass reads a quantized base decoded the same way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from quantmodels import fp8, fp8_config, quantize_model
from safetensors.torch import load_file
from toycodec import TOY, RowScaledInt8, assert_same_results, twins

from resumerge.config.merge_config import load_config_text
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CodecTable
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.runs.moe import load_moe_text
from resumerge.runs.moe.forward import ExpertSets, InThisProcess, Weights, hidden_routers
from resumerge.runs.moe.planner import build_moe_plan

from .models import llamas, write


def _plan(models: list[Path], codecs: CodecTable) -> Plan:
    text = yaml.safe_dump({"base_model": str(models[0]), "gate_mode": "random",
                           "experts": [{"source_model": str(models[1])}, {"source_model": str(models[2])}]})
    config = load_moe_text(text)
    return build_moe_plan(config, open_inputs(config.as_merge_config()).models, PlanOptions(), codecs=codecs)


def test_experts_from_quantized_models_are_those_of_their_decoded_models(tmp_path: Path) -> None:
    models = llamas(tmp_path / "src")
    quantized, plain = [], []
    for m in models:
        q, p = tmp_path / "q" / m.name, tmp_path / "p" / m.name
        twins(m, q, p)
        quantized.append(q)
        plain.append(p)
    from_codes, from_values = _plan(quantized, TOY), _plan(plain, CodecTable())
    assert from_codes.tensors.keys() == from_values.tensors.keys()
    assert not any(n.endswith("_scale") for n in from_codes.tensors)
    assert any(r.codec == RowScaledInt8() for tp in from_codes.tensors.values() for r in tp.inputs)
    assert_same_results(from_codes, from_values)


def test_a_hidden_gate_pass_reads_a_block_fp8_base_through_its_codec(tmp_path: Path) -> None:
    # The forward pass's base decoded as the merge decodes it: the same routers, byte for byte, as the pass over
    # the base stored decoded (both cast to bfloat16 from the same float32 values); raw codes would differ.
    base, _ = llamas(tmp_path / "src", count=2)
    quantize_model(base, tmp_path / "decoded", fp8((16, 16)), fp8_config((16, 16)))
    sets: ExpertSets = [((((5, 9, 3),), ((1, 1, 1),)), (((7, 2),), ((1, 1),))),
                        ((((4, 6, 8, 1),), ((1, 1, 1, 1),)), None)]
    routers = []
    for name, model in (("quantized", base), ("decoded", tmp_path / "decoded")):
        text = write(tmp_path / f"{name}.yml", {"merge_method": "passthrough", "slices": [
            {"sources": [{"model": str(model), "layer_range": [0, 2]}]}]}).read_text()
        opened = next(iter(open_inputs(load_config_text(text)).models.values()))
        located = {n: (t.file, t.entry.start, t.entry.end, t.entry.dtype, t.entry.shape)
                   for n, t in opened.tensors.items()}
        assert any(d == "F8_E4M3" for _, _, _, d, _ in located.values()) == (name == "quantized")
        done = hidden_routers(InThisProcess(Weights(model, located), "hidden"), sets, tmp_path / f"work-{name}")
        routers.append(load_file(done))
    quantized, decoded = routers
    assert sorted(quantized) == sorted(decoded) == ["layers.0", "layers.1"]
    for name, t in decoded.items():
        assert torch.equal(quantized[name].view(torch.uint8), t.view(torch.uint8)), name


def test_an_upcycled_block_fp8_base_loads_with_transformers_as_what_was_written(tmp_path: Path) -> None:
    # Every MoE output tensor is stored plainly (decoded), so config.json must not keep the base's FP8
    # quantization_config: transformers would read the plain tensors as FP8 (the plain merge path's rule).
    from transformers import AutoModelForCausalLM

    from resumerge import api

    models = llamas(tmp_path / "src")
    quantize_model(models[0], tmp_path / "decoded", fp8((16, 16)), fp8_config((16, 16)))
    assert "quantization_config" in json.loads((models[0] / "config.json").read_text())
    config = write(tmp_path / "moe.yml", {"base_model": str(models[0]), "gate_mode": "random",
                                          "experts": [{"source_model": str(models[1])},
                                                      {"source_model": str(models[2])}]})
    out = tmp_path / "out"
    api.run(config, out, settings=api.Settings(merging=api.Merging(random_seed=7), state_dir=tmp_path / "state"))
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written
    stored = {n: t for f in sorted(out.glob("*.safetensors")) for n, t in load_file(f).items()}
    assert all(t.dtype == torch.float32 for t in stored.values())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    state = model.state_dict()
    for name, t in stored.items():
        assert torch.equal(state[name], t), name

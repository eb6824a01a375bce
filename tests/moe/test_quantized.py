"""MoE upcycling from quantized models: the base's and the experts' tensors are decoded through the run's codecs
before they are copied or fused, so the experts are those of the decoded (dequantized) models."""

from __future__ import annotations

from pathlib import Path

import yaml
from toycodec import TOY, RowScaledInt8, assert_same_results, twins

from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs import CodecTable
from resumerge.moe import load_moe_text
from resumerge.moe.planner import build_moe_plan
from resumerge.plan.merge_plan import Plan, PlanOptions

from .models import llamas


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

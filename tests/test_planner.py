"""The planner: layer mapping, parameter precedence and gradients, edges, tying, config, shards, fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import ModelFactory

from resumerge.config.merge_config import load_config_text
from resumerge.config.params import evaluate, gradient_value
from resumerge.errors import ConfigError
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.merge_plan import Plan, PlanOptions
from resumerge.merge.plan.sharding import shard_names


def _plan(text: str, **options: Any) -> Plan:
    return plan_from_config(load_config_text(text), PlanOptions(**options))


def test_gradient_interpolation_matches_mergekit_rule() -> None:
    assert gradient_value([0.0, 1.0], 0.25) == pytest.approx(0.25)
    assert gradient_value([0.0, 0.3, 1.0], 0.75) == pytest.approx(0.65)
    assert gradient_value([0.5], 0.9) == 0.5
    assert evaluate([True, False], "x", 0.6) is True  # element int(t·(n−1))
    assert evaluate([{"filter": "mlp", "value": 0.7}, {"value": 0.3}], "model.layers.0.mlp.up", 0) == 0.7
    assert evaluate([{"filter": "mlp", "value": [0, 1]}, {"value": 0.3}], "a.mlp.b", 0.5) == pytest.approx(0.5)


def test_stacked_slices_renumber_layers(make: ModelFactory) -> None:
    a = make("a", layers=4)
    plan = _plan(f"""
merge_method: passthrough
slices:
  - sources: [{{model: {a}, layer_range: [0, 3]}}]
  - sources: [{{model: {a}, layer_range: [1, 4]}}]
""")
    assert plan.num_layers == 6
    src = plan.tensors["model.layers.3.self_attn.q_proj.weight"].inputs[0].tensor
    assert src == "model.layers.1.self_attn.q_proj.weight"
    assert plan.layer_origins[5] == (str(a), 3)
    assert plan.out_config["num_hidden_layers"] == 6


def test_parameter_precedence_and_t_rule(make: ModelFactory) -> None:
    a, b = make("a", layers=3, seed=1), make("b", layers=3, seed=2)
    plan = _plan(f"""
merge_method: linear
parameters: {{weight: 0.25, normalize: false}}
slices:
  - sources:
      - model: {a}
        layer_range: [0, 3]
        parameters: {{weight: [{{filter: mlp, value: [0.0, 1.0]}}]}}
      - model: {b}
        layer_range: [0, 3]
    parameters: {{weight: 0.5}}
""")
    def weights(name: str) -> list[float]:
        return [dict(p)["weight"] for p in plan.tensors[name].model_params]
    assert weights("model.layers.0.mlp.up_proj.weight") == [0.0, 0.5]
    assert weights("model.layers.1.mlp.up_proj.weight") == [0.5, 0.5]
    assert weights("model.layers.2.mlp.up_proj.weight") == [1.0, 0.5]
    # no filter match falls through to the slice level; non-layer tensors use t = 0
    assert weights("model.layers.2.self_attn.q_proj.weight") == [0.5, 0.5]
    assert weights("model.embed_tokens.weight") == [0.5, 0.5]
    assert dict(plan.tensors["lm_head.weight"].params)["normalize"] is False


def test_edges_come_from_first_and_last_slice(make: ModelFactory) -> None:
    a, b = make("a", layers=2, seed=1), make("b", layers=2, seed=2)
    plan = _plan(f"""
merge_method: passthrough
slices:
  - sources: [{{model: {a}, layer_range: [0, 2]}}]
  - sources: [{{model: {b}, layer_range: [0, 2]}}]
""")
    assert plan.tensors["model.embed_tokens.weight"].inputs[0].model == str(a)
    assert plan.tensors["model.norm.weight"].inputs[0].model == str(b)
    assert plan.tensors["lm_head.weight"].inputs[0].model == str(b)


def test_layer_types_follow_output_layers(make: ModelFactory) -> None:
    a = make("q", arch="qwen2", layers=4)
    plan = _plan(f"""
merge_method: passthrough
slices:
  - sources: [{{model: {a}, layer_range: [0, 3]}}]
  - sources: [{{model: {a}, layer_range: [1, 4]}}]
""")
    assert len(plan.out_config["layer_types"]) == 6


def test_tied_and_untied_inputs(make: ModelFactory) -> None:
    tied, untied = make("t", tied=True, seed=1), make("u", tied=False, seed=2)
    both_tied = _plan(f"merge_method: linear\nparameters: {{weight: 1}}\nmodels: [{tied}, {tied}]\n")
    assert "lm_head.weight" not in both_tied.tensors
    assert both_tied.out_config["tie_word_embeddings"] is True
    mixed = _plan(f"merge_method: linear\nparameters: {{weight: 1}}\nmodels: [{tied}, {untied}]\n")
    head = mixed.tensors["lm_head.weight"]
    assert [i.tensor for i in head.inputs] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert mixed.out_config["tie_word_embeddings"] is False


def test_shards_follow_name_order_and_byte_cap(make: ModelFactory) -> None:
    a = make("a")
    plan = _plan(f"merge_method: passthrough\nmodels: [{a}]\n", out_shard_size=20_000)
    assert [s.name for s in plan.shards] == shard_names(len(plan.shards))
    ordered = sorted(plan.tensors)
    flattened = [n for s in plan.shards for n in sorted(s.tensors)]
    assert flattened == ordered
    for shard in plan.shards:
        data = sum(plan.tensors[n].nbytes for n in shard.tensors)
        assert data <= 20_000 or len(shard.tensors) == 1
    assert shard_names(1) == ["model.safetensors"]


def test_fingerprint_is_stable_and_sensitive(make: ModelFactory, tmp_path: Path) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    text = f"merge_method: linear\nparameters: {{weight: 1}}\nmodels: [{a}, {b}]\n"
    first, again = _plan(text), _plan(text)
    assert first.fingerprint == again.fingerprint
    assert _plan(text, out_shard_size=10_000).fingerprint != first.fingerprint
    assert _plan(text.replace("weight: 1", "weight: 2")).fingerprint != first.fingerprint
    make("b", seed=3)  # same shapes, other weights
    assert _plan(text).fingerprint != first.fingerprint


def test_donor_is_base_else_first_model(make: ModelFactory) -> None:
    a, b = make("a", seed=1), make("b", seed=2)
    assert _plan(f"merge_method: linear\nparameters: {{weight: 1}}\nmodels: [{b}, {a}]\n").donor == str(b)
    plan = _plan(f"merge_method: linear\nbase_model: {a}\nparameters: {{weight: 1}}\nmodels: [{b}]\n")
    assert plan.donor == str(a)
    assert [i.model for i in plan.tensors["model.norm.weight"].inputs] == [str(a), str(b)]


def test_tokenizer_source_must_be_a_merged_model(make: ModelFactory) -> None:
    a = make("a")
    with pytest.raises(ConfigError, match="not one of the merged models") as caught:
        _plan(f"merge_method: passthrough\nmodels: [{a}]\ntokenizer_source: someone/else\n")
    assert caught.value.yaml_path == "tokenizer_source"


def test_the_planner_binds_every_default_as_method_spec_bind_does(make: ModelFactory) -> None:
    # Method bodies read their parameters by name (p["density"]): the planner must hand them every parameter, the
    # unset ones at their ParamSpec default, exactly as MethodSpec.bind does for callers that run a method directly.
    from resumerge.merge.methods import get_method

    a, b = make("a", layers=2, seed=1), make("b", layers=2, seed=2)
    plan = _plan(f"""
merge_method: breadcrumbs_ties
base_model: {a}
models:
  - model: {a}
  - model: {b}
    parameters: {{weight: 0.5, gamma: 0.02}}
""")
    spec = get_method("breadcrumbs_ties")
    assert spec is not None
    tp = plan.tensors["model.layers.1.mlp.up_proj.weight"]
    assert tp.base_index == 0
    model_params, params = spec.bind([{}, {"weight": 0.5, "gamma": 0.02}], {}, 0)
    assert dict(tp.params) == params and [dict(p) for p in tp.model_params] == model_params
    assert set(model_params[1]) == {"weight", "density", "gamma"} and model_params[0] == {}
    assert params == {"int8_mask": False, "normalize": False, "rescale": False, "lambda": 1.0}

"""Per-tensor parameter resolution (plan/parameters.py ParameterResolver): answers are shared between tensors
only where their key is exact, so globs, substrings and gradients still give every tensor its own value."""

from __future__ import annotations

import pytest
from conftest import ModelFactory

from resumerge.config.merge_config import load_config_text
from resumerge.config.params import evaluate
from resumerge.engine.session import plan_from_config
from resumerge.plan.architecture import split_layer_name
from resumerge.plan.merge_plan import PlanOptions

_WEIGHT = [{"filter": "model.layers.*.mlp.*", "value": 0.7}, {"filter": "self_attn", "value": [0.1, 0.9]},
           {"value": 0.3}]


def test_filters_and_gradients_resolve_per_tensor(make: ModelFactory) -> None:
    a, b = make("a", layers=3, seed=1), make("b", layers=3, seed=2)
    plan = plan_from_config(load_config_text(f"""
merge_method: linear
parameters: {{weight: {_WEIGHT}, normalize: false}}
models:
  - model: {a}
  - model: {b}
    parameters: {{weight: 0.5}}
"""), PlanOptions())
    seen = set()
    for name, tp in plan.tensors.items():
        found = split_layer_name(name)
        t = found[1] / 2 if found is not None else 0.0  # 3 layers: t = layer / (3 - 1); edges t = 0
        expected = evaluate(_WEIGHT, tp.inputs[0].tensor, t)
        assert [dict(p)["weight"] for p in tp.model_params] == [pytest.approx(expected), 0.5], name
        assert dict(tp.params)["normalize"] is False
        seen.add(round(expected, 6))
    assert seen == {0.7, 0.1, 0.5, 0.9, 0.3}  # the glob, the gradient at t = 0, 0.5, 1, the catch-all


def test_plain_settings_are_resolved_once(make: ModelFactory) -> None:
    a, b = make("a", layers=3, seed=1), make("b", layers=3, seed=2)
    text = f"merge_method: linear\nparameters: {{weight: 0.5}}\nmodels: [{a}, {b}]\n"
    plan = plan_from_config(load_config_text(text), PlanOptions())
    first = next(iter(plan.tensors.values()))
    assert all(tp.model_params is first.model_params and tp.params is first.params for tp in plan.tensors.values())

"""Per-tensor parameter resolution (merge/plan/parameters.py ParameterResolver): answers are shared between tensors
only where their key is exact, so globs, substrings and gradients still give every tensor its own value."""

from __future__ import annotations

import pytest
from conftest import ModelFactory

from resumerge.config.merge_config import load_config_text
from resumerge.config.params import evaluate
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan.architecture import split_layer_name
from resumerge.merge.plan.merge_plan import PlanOptions

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



# Patterns naming one layer, and no gradient (so the layer position is no part of the key): which inputs they select
# depends on the slices' renumbering.
_LAYER_WEIGHT = [{"filter": "layers.1.", "value": 0.6}, {"filter": "mlp", "value": 0.2}, {"value": 0.3}]
_SOURCE_WEIGHT = [{"filter": "self_attn", "value": 0.8}, {"value": 0.5}]


def test_renumbered_slices_resolve_filters_on_each_input_name(make: ModelFactory) -> None:
    """Output layer i made from input layer j: a source's ``filter:`` is matched against the input's own name, which
    may match a pattern its output name does not (and the other way round), so tensors whose output names match
    alike still get the value each would get alone (computed here by hand, unshared)."""
    a, b = make("a", layers=4, seed=1), make("b", layers=4, seed=2)
    plan = plan_from_config(load_config_text(f"""
merge_method: linear
parameters: {{weight: {_LAYER_WEIGHT}, normalize: false}}
slices:
  - sources:
      - {{model: {a}, layer_range: [2, 4]}}
      - {{model: {b}, layer_range: [0, 2], parameters: {{weight: {_SOURCE_WEIGHT}}}}}
  - sources:
      - {{model: {a}, layer_range: [0, 2]}}
      - {{model: {b}, layer_range: [2, 4], parameters: {{weight: {_SOURCE_WEIGHT}}}}}
"""), PlanOptions())
    seen, differ = set(), 0
    for name, tp in plan.tensors.items():
        in_names = [ref.tensor for ref in tp.inputs]
        expected = [evaluate(_LAYER_WEIGHT, in_names[0], 0.0), evaluate(_SOURCE_WEIGHT, in_names[1], 0.0)]
        assert [dict(p)["weight"] for p in tp.model_params] == [pytest.approx(v) for v in expected], name
        seen.update(expected)
        differ += expected[0] != evaluate(_LAYER_WEIGHT, name, 0.0)
    assert seen == {0.6, 0.2, 0.3, 0.8, 0.5}
    assert differ >= 2  # the output's own name would have given some tensors another value

"""Output tensors made from their kind: every tensor gets the plan that planning it whole gives it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ModelFactory
from quantmodels import fp8, fp8_config
from support import linear_config, write_config
from test_quant_codecs import pair

from resumerge.config.merge_config import load_config_text
from resumerge.inputs.catalog import open_inputs
from resumerge.inputs.codecs.fp8_block import BlockFp8Codec
from resumerge.merge.plan.merge_plan import InputRef, Plan, PlanOptions
from resumerge.merge.plan.planner import build_plan
from resumerge.merge.plan.tensorkinds import KeyKinds, Kind, kind_key


def _fp8_static(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Block FP8 with a static activation scale beside each weight: an output kept in that format carries one."""
    parts = fp8((16, 16))(name, t)
    if parts is not None:
        parts[f"{name.removesuffix('weight')}input_scale"] = torch.tensor([0.5])
    return parts


def _plans(tmp_path: Path, doc: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, Plan, int]:
    """The plan of ``doc`` with kinds shared, the plan with every tensor planned whole, and how many tensors the
    first made from a kind."""
    config = load_config_text(write_config(tmp_path / "c.yml", doc).read_text())
    models = open_inputs(config).models
    made: list[str] = []
    plan_of = Kind.plan
    with monkeypatch.context() as m:
        m.setattr(Kind, "plan", lambda kind, name, inputs: made.append(name) or plan_of(kind, name, inputs))
        shared = build_plan(config, models, PlanOptions())
    with monkeypatch.context() as m:
        m.setattr(KeyKinds, "get", lambda *args: None)
        whole = build_plan(config, models, PlanOptions())
    return shared, whole, len(made)


def test_a_tensor_made_from_its_kind_is_the_tensor_planned_whole(tmp_path: Path, make: ModelFactory,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair(tmp_path, make, _fp8_static, fp8_config((16, 16)))
    base = make("base", seed=3, hidden=64, intermediate=128, layers=3)
    other = make("other", seed=4, hidden=64, intermediate=128, layers=3)
    docs: list[dict[str, object]] = [
        linear_config(a, b, weights=(0.5, 0.5)),  # carried activation scales: the base's (the first model's)
        linear_config(a, b, weights=(0, 1)),  # one-hot: copies of the second model's stored parts and scales
        {"merge_method": "ties", "base_model": str(base), "dtype": "float32", "models": [
            {"model": str(other), "parameters": {"weight": [0.2, 0.8], "density": [
                {"filter": "mlp", "value": 0.3}, {"value": 0.6}]}}]},
    ]
    carriers = []
    for i, doc in enumerate(docs):
        (tmp_path / str(i)).mkdir()
        shared, whole, made = _plans(tmp_path / str(i), doc, monkeypatch)
        assert shared == whole
        assert 0 < made < len(shared.tensors)
        carriers.append([tp for tp in shared.tensors.values() if tp.carried])
    # The scales carried are the base's (the first model's), or those of the input copied.
    assert carriers[0] and all(tp.carried[0][1].model == tp.inputs[0].model for tp in carriers[0])
    assert carriers[1] and all(tp.copy_of == 1 and tp.carried[0][1].model == tp.inputs[1].model
                               for tp in carriers[1])


def test_every_input_field_but_where_it_is_stored_is_in_the_kind() -> None:
    scale = InputRef("a", "f", "w_scale", "F32", (1, 1), 64, 68)
    ref = InputRef("a", "f", "w", "BF16", (4, 8), 0, 64, companions=(("scale", scale),))
    moved = replace(ref, model="b", file="g", tensor="v", start=128, end=192,
                    companions=(("scale", replace(scale, model="b", file="g", start=0, end=4)),))
    key = kind_key("linear", None, None, [ref, ref])
    assert kind_key("linear", None, None, [moved, ref]) == key
    changed = [
        replace(ref, dtype="F16"), replace(ref, shape=(8, 4)), replace(ref, cast="F32"), replace(ref, first_row=4),
        replace(ref, codec=BlockFp8Codec((2, 2))), replace(ref, companions=()),
        replace(ref, companions=(("scale", replace(scale, shape=(2, 1))),)),
        replace(ref, companions=(("scale", replace(scale, dtype="BF16")),)),
        replace(ref, companions=(("zero_point", scale),)),
    ]
    keys = {key, kind_key("slerp", None, None, [ref, ref]), kind_key("linear", 0, None, [ref, ref]),
            kind_key("linear", None, 8, [ref, ref]), *(kind_key("linear", None, None, [c, ref]) for c in changed)}
    assert len(keys) == len(changed) + 4
    assert kind_key("linear", None, None, [replace(ref, lora=object()), ref]) is None  # type: ignore[arg-type]

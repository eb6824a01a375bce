"""The plan's fingerprint as recorded runs know it: its plan part hashed as rendered, a chunk of tensors at a time,
is the sha256 of the one-shot JSON of the whole body; the parts are kept on the plan, never stale; and planning runs
with the cyclic garbage collector paused, which it leaves as it found it."""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import replace

import pytest
from quantmodels import fp8, fp8_config, quantize_model

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.engine.session import plan_from_config
from resumerge.memory import collector_paused
from resumerge.plan import merge_plan
from resumerge.plan.merge_plan import Plan, PlanOptions, compute_fingerprint, fingerprint_parts


def _one_shot_plan_part(plan: Plan) -> str:
    """The plan part as it was computed before it was streamed: one json.dumps of the whole body."""
    identities: dict[int, list[object]] = {}
    body = {"method": plan.method,
            "tensors": [merge_plan._tensor_doc(plan.tensors[n], identities) for n in sorted(plan.tensors)],
            "shards": [{"name": s.name, "tensors": s.tensors, "file_size": s.file_size} for s in plan.shards],
            "donor": plan.donor, "tokenizer_donor": plan.tokenizer_donor, "layer_origins": plan.layer_origins,
            "out_config": plan.out_config, "tokenizer_files": plan.tokenizer_files, "vocab": plan.vocab_digest}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=merge_plan._json_default)
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def fp8_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """A linear merge of a block-FP8 model (codec identities and companions in its records) with a plain one."""
    root = tmp_path_factory.mktemp("fp8")
    a = make_model(root / "a", ModelSpec(), seed=1)
    make_model(root / "b", ModelSpec(), seed=2)
    quantize_model(a, root / "a-ref", fp8((16, 16)), fp8_config((16, 16)))
    text = f"merge_method: linear\nbase_model: {a}\nmodels: [{{model: {a}, parameters: {{weight: 0.3}}}}, " \
           f"{{model: {root / 'b'}, parameters: {{weight: 0.7}}}}]\n"
    return plan_from_config(load_config_text(text), PlanOptions())


@pytest.mark.parametrize("at_once", [1, 2, 1024])
def test_the_plan_part_hashed_as_rendered_is_the_one_shot_json_s(fp8_plan: Plan, at_once: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert any(not t.out_codec.plain for t in fp8_plan.tensors.values())
    monkeypatch.setattr(merge_plan, "_TENSORS_AT_ONCE", at_once)
    assert fingerprint_parts(replace(fp8_plan, parts=()))["plan"] == _one_shot_plan_part(fp8_plan)
    assert compute_fingerprint(fp8_plan) == fp8_plan.fingerprint


def test_the_kept_parts_are_the_fingerprint_s_and_never_outlive_it(fp8_plan: Plan) -> None:
    assert dict(fp8_plan.parts) == fingerprint_parts(replace(fp8_plan, parts=()))
    # Another fingerprint (a plan changed and fingerprinted by hand): the parts are rendered again from the plan.
    fewer = replace(fp8_plan, tensors=dict(list(fp8_plan.tensors.items())[1:]), fingerprint="changed")
    assert fingerprint_parts(fewer)["plan"] != dict(fp8_plan.parts)["plan"]
    assert compute_fingerprint(replace(fewer, fingerprint=fp8_plan.fingerprint)) != fp8_plan.fingerprint
    again = merge_plan.fingerprinted(fewer)
    assert dict(again.parts) == fingerprint_parts(replace(again, parts=())) and again.fingerprint != "changed"


def test_the_collector_is_paused_in_the_block_and_left_as_it_was_found() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            pass
        assert not gc.isenabled()  # the inner block leaves it as the outer one set it
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # disabled by its caller: left disabled
    finally:
        gc.enable()

"""The plan's fingerprint as recorded runs know it: its plan part hashed as rendered, a chunk of tensors at a time,
is the sha256 of the one-shot JSON of the whole body; the parts are kept on the plan, never stale; and planning runs
with the cyclic garbage collector paused, which it leaves as it found it."""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import asdict, fields, is_dataclass, replace

import pytest
from quantmodels import fp8, fp8_config, quantize_model

from resumerge.cli.modelgen import ModelSpec, make_model
from resumerge.config.merge_config import load_config_text
from resumerge.inputs.codecs import BlockFp8Codec
from resumerge.machine.memory import collector_paused
from resumerge.merge.engine.session import plan_from_config
from resumerge.merge.plan import merge_plan
from resumerge.merge.plan.merge_plan import (
    ExpertStack,
    InputRef,
    LoraRef,
    Plan,
    PlanOptions,
    ShardPlan,
    TensorPlan,
    compute_fingerprint,
    fingerprint_parts,
)
from resumerge.outputs.containers import PeftAdapter


def _one_shot_plan_part(plan: Plan) -> str:
    """The plan part as recorded runs computed it: one json.dumps of the whole body, each tensor's record the JSON
    of ``dataclasses.asdict`` of its plan but its inputs as lists and its later fields only when set."""
    identities: dict[int, list[object]] = {}
    body: dict[str, object] = {
        "method": plan.method, "tensors": [_tensor_doc(plan.tensors[n], identities) for n in sorted(plan.tensors)],
        "shards": [{"name": s.name, "tensors": s.tensors, "file_size": s.file_size} for s in plan.shards],
        "donor": plan.donor, "tokenizer_donor": plan.tokenizer_donor, "layer_origins": plan.layer_origins,
        "out_config": plan.out_config, "tokenizer_files": plan.tokenizer_files, "vocab": plan.vocab_digest}
    side_files = plan.container.side_files()
    if side_files:
        body["side_files"] = {n: hashlib.sha256(b).hexdigest() for n, b in sorted(side_files.items())}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(text.encode()).hexdigest()


def _tensor_doc(t: TensorPlan, identities: dict[int, list[object]]) -> dict[str, object]:
    doc = {f.name: getattr(t, f.name) for f in fields(TensorPlan)
           if f.name not in ("inputs", "out_codec", "copy_of", "experts", "blocks", "carried")}
    doc["inputs"] = [_input_doc(i, identities) for i in t.inputs]
    if not t.out_codec.plain:
        doc["out_codec"] = identities.setdefault(id(t.out_codec), list(t.out_codec.identity()))
    for later in ("copy_of", "experts", "blocks"):
        if getattr(t, later) is not None:
            doc[later] = getattr(t, later)
    if t.carried:
        doc["carried"] = [[part, _input_doc(ref, identities)] for part, ref in t.carried]
    return doc


def _input_doc(i: InputRef, identities: dict[int, list[object]]) -> list[object]:
    doc: list[object] = [i.model, i.file, i.tensor, i.dtype, list(i.shape)]
    if i.cast is not None:
        doc.append(["cast", i.cast])
    if i.lora is not None:
        lora = i.lora
        doc.append(["lora", _input_doc(lora.a, identities), _input_doc(lora.b, identities), lora.scale,
                    lora.fan_in_fan_out, lora.embedding])
    if not i.codec.plain:
        doc.append(["codec", *identities.setdefault(id(i.codec), list(i.codec.identity())),
                    *([part, _input_doc(c, identities)] for part, c in i.companions)])
    return doc


def _json_default(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return list(value)  # type: ignore[call-overload]


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


def _odd_plan() -> Plan:
    """Records of every shape a plan's tensors take: casts, LoRA deltas, codecs with companions, carried parts, copies,
    expert stacks, parameters that are equal but render apart (1, 1.0, True; lists, a dataclass, NaN), and text
    with quotes, ``%``, escapes and non-ASCII characters."""
    fp8, other = BlockFp8Codec((128, 128)), BlockFp8Codec((64, 64), fused=True)
    scale = InputRef("a", "w%s.safetensors", "l.0.w_scale", "F32", (2, 2), 0, 16)
    main = InputRef("a", "w%s.safetensors", "l.0.w", "F8_E4M3", (256, 256), 16, 65552, codec=fp8,
                    companions=(("scale", scale),))
    lora = LoraRef(InputRef("lo", "ad.safetensors", "A", "F32", (4, 8), 0, 128),
                   InputRef("lo", "ad.safetensors", "B", "F32", (8, 4), 128, 256), 0.5, False, True)
    plain = InputRef("b \"q\" é", "x.safetensors", "l.0.w\n", "BF16", (256, 256), 0, 131072, cast="F32",
                     lora=lora, first_row=3)
    base = TensorPlan("l.0.w", "s-1", "linear", (main, plain), 0, ((("weight", 1),), (("weight", 1.0),)),
                      (("normalize", True), ("t", [0.5, float("nan")])), (256, 256), "float32", "F32", 100)
    tensors = [
        base,
        replace(base, name="l.1.w", model_params=((("weight", True),), (("weight", 1),)), params=(("t", 1.0),),
                out_codec=fp8, copy_of=1, vocab_aligned=True),
        replace(base, name="l.2.w%d", shard="s-2", inputs=(replace(main, codec=other),), experts=ExpertStack(4, 2),
                carried=(("input_scale", scale),), params=(("t", ExpertStack(1)),), base_index=None),
        replace(base, name="l.3.ü", inputs=(replace(main, companions=()), main), out_codec=other, nbytes=2 ** 40),
        replace(base, name="l.4.w", inputs=(), shape=(), model_params=(), params=(), compute_dtype=None),
    ]
    return Plan(method="linear", tensors={t.name: t for t in tensors},
                shards=(ShardPlan("s-1", ("l.0.w",), 10), ShardPlan("s-2", ("l.2.w%d",), 20)), donor="a",
                tokenizer_donor=None, num_layers=5, layer_origins=(("a", 0),), inputs={}, model_dirs={},
                container=PeftAdapter({"adapter_config.json": b"{}"}))


def test_the_plan_part_renders_every_kind_of_record_as_recorded_runs_did() -> None:
    plan = _odd_plan()
    assert fingerprint_parts(plan)["plan"] == _one_shot_plan_part(plan)
    # Each tensor alone, so that no record is found from another's form.
    for name, t in plan.tensors.items():
        alone = replace(plan, tensors={name: t})
        assert fingerprint_parts(alone)["plan"] == _one_shot_plan_part(alone), name


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

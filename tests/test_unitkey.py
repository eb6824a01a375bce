"""Units of work sized once per class of tensors: the key leaves out only where a tensor's bytes are."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from conftest import ModelFactory
from support import write_config

from resumerge import api
from resumerge.analyses.estimate.memory import pending_units
from resumerge.inputs.codecs import PLAIN
from resumerge.merge.plan.merge_plan import ExpertStack, InputRef, TensorPlan
from resumerge.merge.plan.unitkey import TensorClasses, sizing_key
from resumerge.merge.plan.workunits import ROWS, oversized_units, streamed_bytes, unit_bytes, unit_mode


def _ref(file: str, tensor: str, start: int, **changes: object) -> InputRef:
    ref = InputRef("a", file, tensor, "BF16", (4, 8), start, start + 64)
    scale = InputRef("a", file, f"{tensor}_scale", "F32", (1, 1), start + 64, start + 68)
    return replace(ref, companions=(("scale", scale),), **changes)  # type: ignore[arg-type]


def _tensor(name: str, shard: str, file: str, start: int) -> TensorPlan:
    return TensorPlan(name, shard, "linear", (_ref(file, name, start), _ref(file, f"{name}.b", start + 128)), None,
                      ((("weight", 0.5),), (("weight", 0.5),)), (("normalize", True),), (4, 8), None, "BF16", 64)


def test_tensors_that_differ_only_in_where_their_bytes_are_share_a_key() -> None:
    one = _tensor("model.layers.0.mlp.up_proj.weight", "model-00001.safetensors", "in-1.safetensors", 0)
    other = _tensor("model.layers.7.mlp.up_proj.weight", "model-00009.safetensors", "in-4.safetensors", 4096)
    assert sizing_key(one) == sizing_key(other)
    classes = TensorClasses([one, other])
    # members is a contract, not an internal: oversized_units answers each class through its first tensor there.
    assert classes.number(one) == classes.number(other) == 0 and classes.members == [one]
    asked: list[str] = []
    answer = classes.per_class(lambda tp: asked.append(tp.name) or len(asked))
    assert [answer(one), answer(other), answer(one)] == [1, 1, 1] and asked == [one.name]


def test_every_other_field_is_in_the_key() -> None:
    tp = _tensor("w", "s", "f", 0)
    first = tp.inputs[0]
    scale = first.companions[0][1]
    changed = [
        replace(tp, method="slerp"), replace(tp, shape=(8, 4)), replace(tp, compute_dtype="float32"),
        replace(tp, out_dtype="F32"), replace(tp, nbytes=128), replace(tp, vocab_aligned=True),
        replace(tp, params=(("normalize", False),)), replace(tp, model_params=((("weight", 0.4),), (("weight", 0.6),))),
        replace(tp, base_index=0), replace(tp, copy_of=0), replace(tp, experts=ExpertStack(4)),
        replace(tp, inputs=tp.inputs[:1]), replace(tp, carried=(("input_scale", scale),)),
        replace(tp, inputs=(replace(first, dtype="F16"), tp.inputs[1])),
        replace(tp, inputs=(replace(first, shape=(8, 4)), tp.inputs[1])),
        replace(tp, inputs=(replace(first, end=first.end + 2), tp.inputs[1])),
        replace(tp, inputs=(replace(first, cast="F32"), tp.inputs[1])),
        replace(tp, inputs=(replace(first, model="b"), tp.inputs[1])),
        replace(tp, inputs=(replace(first, first_row=2), tp.inputs[1])),
        replace(tp, inputs=(replace(first, companions=(("scale", replace(scale, shape=(2, 1), end=scale.end + 4)),)),
                            tp.inputs[1])),
        replace(tp, inputs=(replace(first, companions=()), tp.inputs[1])),
    ]
    assert first.codec is PLAIN
    keys = {sizing_key(tp), *(sizing_key(c) for c in changed)}
    assert len(keys) == len(changed) + 1


def test_a_key_that_cannot_be_hashed_is_answered_on_its_own() -> None:
    tp = _tensor("w", "s", "f", 0)
    odd = replace(tp, name="odd", params=(("weights", [0.5, 0.5]),))
    also = replace(odd, name="also")
    classes = TensorClasses([tp, odd, also, replace(tp, name="v")])
    assert [classes.number(t) for t in (tp, odd, also)] == [0, 1, 2] and classes.members == [tp, odd, also]
    asked: list[str] = []
    answer = classes.per_class(lambda t: asked.append(t.name) or len(asked))
    assert [answer(odd), answer(also), answer(odd)] == [1, 2, 1]


def test_the_estimate_sizes_every_tensor_as_the_engine_rule_does(tmp_path: Path, make: ModelFactory) -> None:
    base, a = (make(n, seed=i, hidden=64, intermediate=128, layers=3) for i, n in enumerate("xa"))
    cfg = write_config(tmp_path / "ties.yml", {
        "merge_method": "ties", "base_model": str(base), "dtype": "float32",
        "models": [{"model": str(a), "parameters": {"weight": 0.5, "density": 0.5}}],
    })
    plan = api.plan_merge(cfg, settings=api.Settings(output=api.Output(out_shard_size="60k")))
    for budget in (1 << 30, 200_000):  # a small budget streams the larger tensors in rows
        expected = []
        for shard in plan.shards:
            for name in shard.tensors:
                tp = plan.tensors[name]
                method = plan.method_of(tp)
                mode = unit_mode(tp, method, budget, plan.options.device)
                expected.append((streamed_bytes(tp, method), True) if mode == ROWS
                                else (unit_bytes(tp, method, mode), False))
        # Consecutive whole tensors of one shard may be admitted as one group (merge/engine/unitgroup.py): each unit is
        # then the sum of the next tensors' own sizes, in order; a streamed tensor is always a unit of its own.
        left = iter(expected)
        for size, chunked in pending_units(plan, plan.shards, budget):
            first, first_chunked = next(left)
            total = first
            while total < size and not first_chunked:
                more, more_chunked = next(left)
                assert not more_chunked
                total += more
            assert (total, first_chunked) == (size, chunked)
        assert next(left, None) is None
        assert any(chunked for _, chunked in expected) == (budget < 1 << 30)
    need = {u.tensor: u.needed for u in oversized_units(plan, 1, 0)}
    assert set(need) == set(plan.tensors) and len(set(need.values())) > 1

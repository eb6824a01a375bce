"""Fused expert stacks are merged per expert (and per projection) by every method that is not elementwise.

End to end, each tiny gpt-oss input holds its fused tensors (``gate_up_proj`` [E, H, 2I] with gate and up
interleaved on the last axis, its bias, ``down_proj`` and its bias) beside the same experts stored one by one under
per-expert names: one merge makes both, and expert e's gate (up, down, biases) of the fused output equals the
per-expert output's; a randomised method's expert does not move when a neighbour expert of one input changes. The
engine's split alone is checked for every method that is not elementwise and every layout (transformers 5's
[E, 2I, H], the transposed [E, H, 2I] of Llama-4 and Qwen3-VL-MoE, gpt-oss's interleaved one, a down stack). An
MXFP4-stored stack (every gpt-oss checkpoint's format) merges to the bytes of its decoded model's: each expert's
blocks and scales are read and decoded alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from quantmodels import MXFP4_CONFIG, mxfp4_experts
from safetensors.torch import load_file, save_file

from resumerge import api
from resumerge.analyses.estimate.compute import measure_compute
from resumerge.errors import ModelInputError
from resumerge.inputs.safetensors_format import numel
from resumerge.merge.engine import compute
from resumerge.merge.engine.experts import merge_by_expert
from resumerge.merge.methods.registry import get_method, method_names
from resumerge.merge.methods.spec import MergeContext
from resumerge.merge.plan import workunits
from resumerge.merge.plan.experts import FUSED_LAYOUTS, StackFamily, expert_stack, mark_expert_stacks
from resumerge.merge.plan.merge_plan import ExpertStack, InputRef, TensorPlan

EXPERTS, HIDDEN, INTER = 3, 6, 4
LAYER = "model.layers.0.mlp"
OSS = f"{LAYER}.experts"  # gpt-oss's fused stacks
PAIR_METHODS = ("slerp", "arcee_fusion")  # methods of exactly two inputs
PARAMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # method: (per-model, method-level parameters)
    "slerp": ({}, {"t": 0.3}),
    "nuslerp": ({"weight": 0.6}, {}),
    "multislerp": ({"weight": 0.5}, {}),
    "arcee_fusion": ({}, {}),
    "model_stock": ({}, {}),
    "karcher": ({}, {}),
    "sce": ({"weight": 0.5}, {"select_topk": 0.5}),
    "ramplus_tl": ({}, {}),
}
NON_ELEMENTWISE = [n for n in method_names() if not get_method(n).elementwise]  # type: ignore[union-attr]


def _model(directory: Path, seed: int, *, nudge: int | None = None) -> Path:
    """A one-layer gpt-oss-like input of seed ``seed``; ``nudge``: expert 1 of every stack changed, nothing else."""
    g = torch.Generator().manual_seed(seed)
    fused = {
        f"{OSS}.gate_up_proj": torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g),
        f"{OSS}.gate_up_proj_bias": torch.randn(EXPERTS, 2 * INTER, generator=g),
        f"{OSS}.down_proj": torch.randn(EXPERTS, INTER, HIDDEN, generator=g),
        f"{OSS}.down_proj_bias": torch.randn(EXPERTS, HIDDEN, generator=g),
    }
    if nudge is not None:
        for t in fused.values():
            t[1] += 0.5 * torch.randn(t[1].shape, generator=torch.Generator().manual_seed(nudge))
    tensors = dict(fused)
    for e in range(EXPERTS):
        tensors |= {f"{p}.{e}.{n}": t.clone() for p, n, t in _unfused(fused, e)}
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 1,
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_local_experts": EXPERTS}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _unfused(fused: dict[str, torch.Tensor], e: int) -> list[tuple[str, str, torch.Tensor]]:
    """Expert ``e`` of the ``fused`` stacks as a checkpoint storing experts one by one would hold it: (prefix,
    name, tensor) — the oracle's layout, split here by index arithmetic alone."""
    oss_gate_up, oss_bias = fused[f"{OSS}.gate_up_proj"][e], fused[f"{OSS}.gate_up_proj_bias"][e]
    return [
        (OSS, "gate_proj.weight", oss_gate_up[:, 0::2]), (OSS, "up_proj.weight", oss_gate_up[:, 1::2]),
        (OSS, "gate_proj.bias", oss_bias[0::2]), (OSS, "up_proj.bias", oss_bias[1::2]),
        (OSS, "down_proj.weight", fused[f"{OSS}.down_proj"][e]),
        (OSS, "down_proj.bias", fused[f"{OSS}.down_proj_bias"][e]),
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    return {"base": _model(root / "base", 0), "a": _model(root / "a", 1), "b": _model(root / "b", 2),
            "b-nudged": _model(root / "b-nudged", 2, nudge=7)}


def _merge(tmp_path: Path, method: str, models: dict[str, Path], b: str = "b") -> dict[str, torch.Tensor]:
    per_model, params = PARAMS.get(method, ({"weight": 0.5, "density": 0.5}, {}))
    others = [models[b]] if method in PAIR_METHODS else [models["a"], models[b]]
    doc = {"merge_method": method, "base_model": str(models["base"]), "parameters": params, "dtype": "float32",
           "models": [{"model": str(p), "parameters": per_model} for p in (models["base"], *others)]}
    out = tmp_path / f"out-{b}"
    api.run(yaml.safe_dump(doc, sort_keys=False), out, settings=api.Settings(state_dir=tmp_path / f"state-{b}"))
    return load_file(str(next(out.glob("*.safetensors"))))


@pytest.mark.parametrize("method", ["ties"])
def test_fused_expert_equals_the_same_expert_merged_alone(tmp_path: Path, models: dict[str, Path],
                                                            method: str) -> None:
    out = _merge(tmp_path, method, models)
    for e in range(EXPERTS):
        for prefix, name, fused_part in _unfused(out, e):
            torch.testing.assert_close(fused_part, out[f"{prefix}.{e}.{name}"], rtol=1e-5, atol=1e-6,
                                       msg=f"{method}: expert {e} {prefix} {name}")


@pytest.mark.parametrize("method", ["della"])
def test_an_expert_does_not_depend_on_its_neighbours(tmp_path: Path, models: dict[str, Path], method: str) -> None:
    before, after = _merge(tmp_path, method, models), _merge(tmp_path, method, models, b="b-nudged")
    for name in (f"{OSS}.gate_up_proj", f"{OSS}.gate_up_proj_bias", f"{OSS}.down_proj"):
        assert not torch.equal(before[name][1], after[name][1]), name  # the nudge reached expert 1
        for e in (0, 2):
            assert torch.equal(before[name][e], after[name][e]), f"{method}: {name} expert {e}"


LAYOUTS = {  # name: (stack, shape of the fused tensor, how expert e's projection p is cut from it)
    "gpt-oss": (ExpertStack(EXPERTS, 2, 1, True), (EXPERTS, HIDDEN, 2 * INTER), lambda t, e, p: t[e][:, p::2]),
    "gpt-oss bias": (ExpertStack(EXPERTS, 2, 0, True), (EXPERTS, 2 * INTER), lambda t, e, p: t[e][p::2]),
    "transformers 5": (ExpertStack(EXPERTS, 2, 0), (EXPERTS, 2 * INTER, HIDDEN),
                       lambda t, e, p: t[e][p * INTER:(p + 1) * INTER]),
    "transposed": (ExpertStack(EXPERTS, 2, 1), (EXPERTS, HIDDEN, 2 * INTER),
                   lambda t, e, p: t[e][:, p * INTER:(p + 1) * INTER]),
    "down": (ExpertStack(EXPERTS), (EXPERTS, INTER, HIDDEN), lambda t, e, p: t[e]),
}


@pytest.mark.parametrize("method", NON_ELEMENTWISE)
def test_each_projection_of_each_expert_is_merged_alone(method: str) -> None:
    """The engine's split without reading files, for every method that is not elementwise and every layout: the
    randomised ones too, each expert's generator seeded alike for the stack and for the expert alone."""
    spec = get_method(method)
    assert spec is not None
    per_model, params = PARAMS.get(method, ({"weight": 0.5, "density": 0.5}, {}))
    count = 2 if method in PAIR_METHODS else 3
    model_params, method_params = spec.bind([per_model] * count, params, 0)

    def context(tensors: list[torch.Tensor], generator: torch.Generator | None) -> MergeContext:
        return MergeContext(tensors, 0, model_params, method_params, generator=generator)

    def generator(name: str) -> torch.Generator | None:
        return torch.Generator().manual_seed(int(name[-2])) if spec.randomized else None  # "NAME[e]": seed e

    for layout, (stack, shape, cut) in LAYOUTS.items():
        g = torch.Generator().manual_seed(len(layout))
        inputs = [torch.randn(shape, generator=g) for _ in range(count)]
        tp = _plan(shape, stack, count)
        out = merge_by_expert(tp, functools.partial(_expert_context, inputs, context, generator), spec.fn)
        for e in range(EXPERTS):
            drawn = generator(f"{tp.name}[{e}]")
            for p in range(stack.parts):
                alone = spec.fn(context([cut(t, e, p).contiguous() for t in inputs], drawn))
                torch.testing.assert_close(cut(out, e, p), alone, msg=f"{method}, {layout}: expert {e} part {p}")


def _expert_context(inputs: list[torch.Tensor],
                    context: Callable[[list[torch.Tensor], torch.Generator | None], MergeContext],
                    generator: Callable[[str], torch.Generator | None], part: TensorPlan) -> MergeContext:
    """The context of ``part``, one expert's rows of ``inputs`` (as the engine's load reads them)."""
    first = part.inputs[0].first_row
    return context([t[first:first + 1] for t in inputs], generator(part.name))


def _plan(shape: tuple[int, ...], stack: ExpertStack, count: int) -> TensorPlan:
    """A plan of a ``shape`` stack of ``count`` float32 inputs (their byte ranges are never read)."""
    size = 4 * numel(shape)
    ref = InputRef("m", "model.safetensors", "t", "F32", shape, 0, size)
    return TensorPlan("t", "", "any", (ref,) * count, 0, ((),) * count, (), shape, None, "F32", size,
                      experts=stack)


def test_which_tensors_are_stacks() -> None:
    def family(model_type: str) -> StackFamily:
        return StackFamily(model_type, 4, 16, FUSED_LAYOUTS[model_type])

    def stack(name: str, shape: tuple[int, ...], model_type: str = "qwen3_moe") -> ExpertStack | None:
        return expert_stack(name, shape, family(model_type), method="ties")

    v5 = stack("model.layers.3.mlp.experts.gate_up_proj", (4, 32, 32))
    assert v5 is not None and (v5.parts, v5.axis, v5.interleaved) == (2, 0, False)  # 2I == H: the family's axis
    llama4 = stack("model.layers.3.feed_forward.experts.gate_up_proj", (4, 32, 32), "llama4_text")
    assert llama4 is not None and (llama4.parts, llama4.axis) == (2, 1)  # the same shape, the other axis
    oss = stack("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 32), "gpt_oss")
    assert oss is not None and (oss.parts, oss.axis, oss.interleaved) == (2, 0, True)
    down = stack("model.layers.0.mlp.experts.down_proj", (4, 32, 16))
    assert down is not None and down.parts == 1
    for name in ("model.layers.0.mlp.experts.1.down_proj.weight",  # one expert, not a stack
                 "model.layers.0.mlp.shared_experts.down_proj.weight"):
        assert stack(name, (32, 16)) is None, name
    for name, shape in (("model.layers.0.mlp.experts.down_proj", (3, 32, 16)),  # not the config's expert count
                        ("model.layers.0.mlp.experts.down_proj", (4, 32)),  # a weight is 3-D
                        ("model.layers.0.mlp.experts.gate_up_proj", (4, 24, 32))):  # gate and up are not 2·16
        with pytest.raises(ModelInputError, match="contradicts"):
            stack(name, shape)


def test_the_planner_marks_stacks_from_the_config_for_methods_that_are_not_elementwise() -> None:
    shape = (4, 24, 32)  # transformers 5's [E, 2I, H] with I = 12
    ref = InputRef("m", "model.safetensors", "t", "F32", shape, 0, 4 * numel(shape))
    names = ("model.language_model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.0.up_proj.weight")
    tensors = {n: TensorPlan(n, "", "ties", (ref, ref), 0, ((), ()), (), shape, None, "F32", 4 * numel(shape))
               for n in names}
    wrapped = {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": 4,
                                                            "moe_intermediate_size": 12}}
    marked = mark_expert_stacks(tensors, wrapped)
    assert marked[names[0]].experts == ExpertStack(4, parts=2, axis=0)
    assert marked[names[1]].experts is None  # one expert's tensor
    linear = {n: dataclasses.replace(tp, method="linear") for n, tp in tensors.items()}
    assert all(tp.experts is None for tp in mark_expert_stacks(linear, wrapped).values())  # elementwise: whole
    deepseek = {"model_type": "deepseek_v3", "n_routed_experts": 4, "moe_intermediate_size": 20}
    with pytest.raises(ModelInputError, match="contradicts"):  # no axis is 2·20 long: the config is not this model's
        mark_expert_stacks(tensors, deepseek)
    with pytest.raises(ModelInputError, match="layout resumerge does not know"):  # a fused stack is never guessed
        mark_expert_stacks(tensors, {"model_type": "llama"})
    assert mark_expert_stacks(linear, {"model_type": "llama"}) == linear  # an elementwise method needs no layout


def _mxfp4_model(directory: Path, decoded: Path, seed: int) -> None:
    """A gpt-oss input whose stacks are stored in MXFP4 (as every gpt-oss checkpoint is) at ``directory``, and the
    same values stored plainly at ``decoded``."""
    g = torch.Generator().manual_seed(seed)
    plain = {f"{OSS}.gate_up_proj": torch.randn(EXPERTS, 32, 64, generator=g),
             f"{OSS}.gate_up_proj_bias": torch.randn(EXPERTS, 64, generator=g),
             f"{OSS}.down_proj": torch.randn(EXPERTS, 32, 32, generator=g)}
    stored = {}
    for name in (f"{OSS}.gate_up_proj", f"{OSS}.down_proj"):
        parts = mxfp4_experts(name, plain[name])
        assert parts is not None
        plain[name] = parts.pop("value")
        stored |= parts
    stored[f"{OSS}.gate_up_proj_bias"] = plain[f"{OSS}.gate_up_proj_bias"]
    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 1,
              "hidden_size": 32, "intermediate_size": 32, "num_local_experts": EXPERTS}
    for where, tensors, extra in ((directory, stored, {"quantization_config": MXFP4_CONFIG}), (decoded, plain, {})):
        where.mkdir()
        save_file(tensors, str(where / "model.safetensors"))
        (where / "config.json").write_text(json.dumps({**config, **extra}))


def test_mxfp4_stacks_are_merged_per_expert_as_their_decoded_values(tmp_path: Path) -> None:
    """Each expert's rows read and decoded alone (its blocks and scales) merge to the bytes of the decoded model's."""
    for i, name in enumerate(("base", "a", "b")):
        _mxfp4_model(tmp_path / name, tmp_path / f"{name}-decoded", i)
    got, want = ({n: tmp_path / f"{n}{suffix}" for n in ("base", "a", "b")} for suffix in ("", "-decoded"))
    merged = {}
    for key, models in (("got", got), ("want", want)):
        doc = {"merge_method": "ties", "base_model": str(models["base"]), "dtype": "float32",
               "models": [{"model": str(models[n]), "parameters": {"weight": 0.5, "density": 0.5}}
                          for n in ("base", "a", "b")]}
        api.run(yaml.safe_dump(doc), tmp_path / key, settings=api.Settings(state_dir=tmp_path / f"state-{key}",
                                                                           output=api.Output(dequantize=True)))
        merged[key] = load_file(str(tmp_path / key / "model.safetensors"))
    assert sorted(merged["got"]) == sorted(merged["want"]) == sorted(f"{OSS}.{n}" for n in (
        "gate_up_proj", "gate_up_proj_bias", "down_proj"))
    for name, t in merged["want"].items():
        assert torch.equal(merged["got"][name], t), name


def test_a_stack_is_never_streamed_and_is_sized_one_expert_at_a_time() -> None:
    """A stream ranks over all of a tensor's rows, so a stack keeps the whole-tensor path; its unit holds one
    expert's inputs, the whole result and the output, less than the whole stack's inputs."""
    spec = get_method("ties")
    assert spec is not None
    shape = (8, 64, 96)
    model_params, params = spec.bind([{"weight": 0.5, "density": 0.5}] * 3, {}, 0)
    stack = dataclasses.replace(_plan(shape, ExpertStack(8, 2, 1, True), 3), method="ties",
                                model_params=tuple(tuple(p.items()) for p in model_params),
                                params=tuple(params.items()))
    whole = dataclasses.replace(stack, experts=None)
    assert workunits.row_stream(whole, spec, "cpu") is not None
    assert workunits.row_stream(stack, spec, "cpu") is None
    assert workunits.unit_mode(stack, spec, 1 << 20, "cpu") == workunits.WHOLE
    one = workunits.estimate_bytes(stack, spec, rows=1)
    assert workunits.estimate_bytes(stack, spec) == one + 2 * 4 * numel(shape)  # the result (F32) and the output
    assert workunits.estimate_bytes(stack, spec) < workunits.estimate_bytes(whole, spec)


def test_plan_times_a_stack_as_the_run_merges_it_one_expert_at_a_time(models: dict[str, Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # plan's timing runs the engine's compute step on its sample rows: a stack's sampled experts merged one by one.
    merged: list[str] = []
    real = compute.merge_by_expert

    def recording(tp: TensorPlan, *args: Any) -> torch.Tensor:
        merged.append(tp.name)
        return real(tp, *args)

    monkeypatch.setattr(compute, "merge_by_expert", recording)
    doc = {"merge_method": "ties", "base_model": str(models["base"]), "dtype": "float32",
           "models": [{"model": str(models[m]), "parameters": {"weight": 0.5, "density": 0.5}}
                      for m in ("base", "a", "b")]}
    plan = api.plan_merge(yaml.safe_dump(doc, sort_keys=False))
    groups = measure_compute(plan, plan.shards, max_seconds=0.05)
    assert [g.seconds_per_element is not None for g in groups] == [True]
    assert merged and set(merged) <= {n for n, tp in plan.tensors.items() if tp.experts is not None}

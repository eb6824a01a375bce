"""Recipes per tensor class (issue 44): ``filter:`` globs over whole names beside mergekit's substrings, each
filter's match count in ``plan``, a filter matching nothing of the merge refused, and every input tensor of a
merge accounted for (merged, copied, renumbered, dropped and why) in ``plan``, ``status --json`` and the card.

The models are GLM-4.5-MoE-shaped checkpoints written here with the names and config.json transformers 5.24 saves
for ``glm4_moe`` (a dense layer 0, then MoE layers of 4 routed experts, a shared expert, a router and its
``e_score_correction_bias``), so no test pays for building them with transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mergekit_oracle import Mergekit
from safetensors.torch import save_file
from support import output_tensors, write_config

from resumerge.api import plan_merge
from resumerge.cli.commands import main
from resumerge.config.params import evaluate, filter_matches
from resumerge.errors import ConfigError
from resumerge.merge.plan.accounting import UNEXPLAINED

EXPERTS = "model.layers.*.mlp.experts.*"
_HIDDEN, _VOCAB, _EXPERTS, _MOE, _DENSE = 32, 64, 4, 16, 48
GLM_CONFIG: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32",
    "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu", "hidden_size": _HIDDEN,
    "initializer_range": 0.02, "intermediate_size": _DENSE, "max_position_embeddings": 64,
    "moe_intermediate_size": _MOE, "n_group": 1, "n_routed_experts": _EXPERTS, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3,
    "num_key_value_heads": 2, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-05,
    "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
    "vocab_size": _VOCAB,
}


def glm_shapes(layers: int = 3) -> dict[str, tuple[int, ...]]:
    """Every tensor of a tiny GLM-4-MoE checkpoint, as transformers 5 saves it, with its shape."""
    h = _HIDDEN
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (_VOCAB, h), "lm_head.weight": (_VOCAB, h),
                                          "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                       f"{p}.self_attn.q_proj.weight": (h, h), f"{p}.self_attn.k_proj.weight": (16, h),
                       f"{p}.self_attn.v_proj.weight": (16, h), f"{p}.self_attn.o_proj.weight": (h, h)})
        mlps = [(f"{p}.mlp", _DENSE)] if i == 0 else [
            *((f"{p}.mlp.experts.{e}", _MOE) for e in range(_EXPERTS)), (f"{p}.mlp.shared_experts", _MOE)]
        for m, width in mlps:
            shapes.update({f"{m}.gate_proj.weight": (width, h), f"{m}.up_proj.weight": (width, h),
                           f"{m}.down_proj.weight": (h, width)})
        if i > 0:
            shapes.update({f"{p}.mlp.gate.weight": (_EXPERTS, h), f"{p}.mlp.gate.e_score_correction_bias": (_EXPERTS,)})
    return shapes


def write_glm(directory: Path, seed: int, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A GLM-4-MoE checkpoint of random float32 weights drawn under ``seed`` (plus ``extra`` tensors)."""
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape in glm_shapes().items()}
    save_file({**tensors, **(extra or {})}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(GLM_CONFIG, indent=2))
    return directory


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("glm")
    yield write_glm(root / "v3", 1), write_glm(root / "r1", 2)


def _chimera(a: Path, b: Path, pattern: str) -> dict[str, Any]:
    """The R1T Chimera recipe: the routed experts (``pattern``) from ``b``, everything else from ``a``."""
    return {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": [{"filter": pattern, "value": 0}, {"value": 1}]}},
        {"model": str(b), "parameters": {"weight": [{"filter": pattern, "value": 1}, {"value": 0}]}}]}


def test_a_filter_with_a_glob_matches_the_whole_name_and_any_other_a_substring() -> None:
    expert, shared = "model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"
    assert filter_matches(EXPERTS, expert) and not filter_matches(EXPERTS, shared)
    assert filter_matches("experts", shared)  # mergekit's substring: the "luck of naming" a glob avoids
    assert not filter_matches("mlp.experts.*", expert)  # a glob is over the whole name, never a part of it
    assert filter_matches("*.experts.[0-1].*", expert) and not filter_matches("*.experts.[2-3].*", expert)
    assert filter_matches("model.layers.?.mlp.*", expert) and not filter_matches("model.layers.?.mlp.*", "lm_head")
    assert not filter_matches("Experts", expert)  # case-sensitive, as the substring is
    assert evaluate([{"filter": EXPERTS, "value": 0.25}, {"value": 1.0}], expert, 0.0) == 0.25
    assert evaluate([{"filter": EXPERTS, "value": 0.25}, {"value": 1.0}], shared, 0.0) == 1.0


def test_a_chimera_recipe_takes_every_routed_expert_from_one_parent(tmp_path: Path, glm: tuple[Path, Path],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    v3, r1 = glm
    cfg = write_config(tmp_path / "chimera.yml", _chimera(v3, r1, EXPERTS))
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    merged, a, b = output_tensors(out), output_tensors(v3), output_tensors(r1)
    assert merged.keys() == a.keys()
    routed = [n for n in merged if ".mlp.experts." in n]
    assert len(routed) == 24
    for name, tensor in merged.items():
        parent = b if name in routed else a  # shared experts, routers and their biases from V3
        assert torch.equal(tensor, parent[name]), name
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert (inputs["tensors"], inputs["merged"], inputs["dropped"]) == (2 * len(a), 2 * len(a), 0)
    assert "input tensors: 116 merged, 0 copied, 0 renumbered, 0 dropped" in inputs["summary"]
    assert "## Input tensors\n\n116 input tensors: 116 merged" in (out / "README.md").read_text()
    assert main(["status", str(out)]) == 0
    assert "inputs       116 input tensors: 116 merged" in capsys.readouterr().out


def test_plan_counts_the_tensors_each_filter_matched(tmp_path: Path, glm: tuple[Path, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    v3, r1 = glm
    doc = _chimera(v3, r1, EXPERTS)
    doc["parameters"] = {"weight": [{"filter": "self_attn", "value": 1}, {"filter": "*", "value": 1}]}
    cfg = write_config(tmp_path / "c.yml", doc)
    assert main(["plan", str(cfg), "--json", "--probe-size", "0", "-j", "1"]) == 0
    found = json.loads(capsys.readouterr().out)["filters"]
    # Every consulted filter, even one an earlier level shadows (the top level's here); "*" is a catch-all.
    assert found == [
        {"yaml_path": "models[0].parameters.weight[0].filter", "pattern": EXPERTS, "tensors": 24},
        {"yaml_path": "parameters.weight[0].filter", "pattern": "self_attn", "tensors": 12},
        {"yaml_path": "models[1].parameters.weight[0].filter", "pattern": EXPERTS, "tensors": 24},
    ]
    assert main(["plan", str(cfg), "--probe-size", "0", "-j", "1"]) == 0
    text = capsys.readouterr().out
    assert f"models[1].parameters.weight[0].filter '{EXPERTS}': 24 tensor(s)" in text
    assert "116 input tensors: 116 merged, 0 copied, 0 renumbered, 0 dropped" in text


@pytest.mark.parametrize(("where", "pattern"), [("model", "model.layer.*.experts.*"), ("slice", "mlp.experts.*"),
                                                 ("top", "self_atn")])
def test_a_filter_that_matches_no_tensor_of_the_merge_is_refused_before_reading(
        tmp_path: Path, glm: tuple[Path, Path], capsys: pytest.CaptureFixture[str], where: str,
        pattern: str) -> None:
    v3, r1 = glm
    setting = {"weight": [{"filter": pattern, "value": 0.3}, {"value": 0.5}]}
    doc: dict[str, Any] = {"merge_method": "linear", "slices": [{"sources": [
        {"model": str(v3), "layer_range": [0, 3]}, {"model": str(r1), "layer_range": [0, 3]}]}]}
    path = {"model": "slices[0].sources[1].parameters", "slice": "slices[0].parameters", "top": "parameters"}[where]
    doc["parameters"] = {"weight": 1.0}
    if where == "model":
        doc["slices"][0]["sources"][1]["parameters"] = setting
    elif where == "slice":
        doc["slices"][0]["parameters"] = setting
    else:
        doc["parameters"] = setting
    cfg = write_config(tmp_path / "c.yml", doc)
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"{path}.weight[0].filter: filter '{pattern}' matches no tensor of this merge" in err[0]
    assert not out.exists()


def test_a_filter_with_no_match_in_its_slice_but_some_in_the_merge_is_counted_not_refused(
        glm: tuple[Path, Path], tmp_path: Path) -> None:
    v3, r1 = glm
    # A config copied between slices: lm_head comes from the last slice, so the first slice's entry matches nothing
    # there (mergekit configs in the wild do this); density is not linear's, so its typo is never consulted.
    params = {"weight": [{"filter": "lm_head", "value": 0.9}, {"value": 0.5}],
              "density": [{"filter": "typo", "value": 0.5}]}
    doc = {"merge_method": "linear", "slices": [
        {"sources": [{"model": str(m), "layer_range": [0, 1]} for m in (v3, r1)], "parameters": params},
        {"sources": [{"model": str(m), "layer_range": [1, 3]} for m in (v3, r1)], "parameters": params}]}
    plan = plan_merge(write_config(tmp_path / "c.yml", doc))
    assert [(f.yaml_path, f.tensors) for f in plan.filters] == [("slices[0].parameters.weight[0].filter", 0),
                                                                 ("slices[1].parameters.weight[0].filter", 1)]


def test_every_input_tensor_of_a_slice_merge_is_accounted_for(glm: tuple[Path, Path], tmp_path: Path) -> None:
    v3, r1 = glm
    doc = {"merge_method": "passthrough", "slices": [{"sources": [{"model": str(v3), "layer_range": [0, 2]}]},
                                                     {"sources": [{"model": str(r1), "layer_range": [1, 3]}]}]}
    accounting = plan_merge(write_config(tmp_path / "c.yml", doc)).accounting
    assert accounting is not None
    a, b = (accounting.models[str(m)] for m in (v3, r1))
    layer = {i: sum(1 for n in glm_shapes() if n.startswith(f"model.layers.{i}.")) for i in range(3)}
    assert (a.copied, a.renumbered, a.merged) == (1 + layer[0] + layer[1], 0, 0)  # the embedding and layers 0, 1
    assert a.dropped == {"layers outside the slices": layer[2],
                         "post-layer tensors come from the last slice's models": 2}
    assert (b.copied, b.renumbered) == (2, layer[1] + layer[2])  # the head and final norm; layers 1, 2 → 2, 3
    assert b.dropped == {"layers outside the slices": layer[0],
                         "pre-layer tensors come from the first slice's models": 1}
    total = accounting.total()
    assert total.merged + total.copied + total.renumbered + sum(total.dropped.values()) == 2 * len(glm_shapes())
    assert UNEXPLAINED not in total.dropped


@pytest.mark.oracle
def test_substring_filters_match_mergekit_on_a_glm_moe_pair(tmp_path: Path, glm: tuple[Path, Path],
                                                             mergekit: Mergekit) -> None:
    v3, r1 = glm
    cfg = write_config(tmp_path / "c.yml", _chimera(v3, r1, "mlp.experts"))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert main(["run", str(cfg), str(ours), "--quiet"]) == 0
    done = mergekit.run(cfg, theirs, "--random-seed", "0", "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    mine, other = output_tensors(ours), output_tensors(theirs)
    for name, tensor in other.items():
        if name in mine:
            assert torch.equal(tensor, mine[name]), name
            continue
        # mergekit 0.1.5 writes GLM's routed experts under transformers' fused in-memory names.
        layer, part = name.removeprefix("model.layers.").split(".mlp.experts.")
        for e in range(tensor.shape[0]):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            want = mine[f"{p}.down_proj.weight"] if part == "down_proj" else torch.cat(
                [mine[f"{p}.gate_proj.weight"], mine[f"{p}.up_proj.weight"]])
            assert torch.equal(tensor[e], want), (name, e)
    assert len(other) == len(mine) - 2 * (3 * _EXPERTS - 2)  # per MoE layer: 12 expert tensors in mergekit's 2


def test_filter_checks_refuse_a_config_through_the_api(glm: tuple[Path, Path], tmp_path: Path) -> None:
    v3, r1 = glm
    cfg = write_config(tmp_path / "c.yml", _chimera(v3, r1, "model.layers.*.mlp.expert.*"))
    with pytest.raises(ConfigError, match=r"matches no tensor of this merge \(a glob over the whole name\)"):
        plan_merge(cfg)


def test_globs_work_in_every_parameter(glm: tuple[Path, Path], tmp_path: Path) -> None:
    v3, r1 = glm
    glob = [{"filter": EXPERTS, "value": 0.2}, {"value": 0.8}]
    doc = {"merge_method": "della", "base_model": str(v3), "parameters": {"lambda": glob}, "models": [
        {"model": str(v3)}, {"model": str(r1), "parameters": {"weight": glob, "density": glob, "epsilon": [
            {"filter": "model.layers.[12].mlp.gate.*", "value": 0.05}, {"value": 0.1}]}}]}
    plan = plan_merge(write_config(tmp_path / "c.yml", doc))
    expert = plan.tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    router = plan.tensors["model.layers.1.mlp.gate.weight"]
    assert dict(expert.params)["lambda"] == 0.2 and dict(router.params)["lambda"] == 0.8
    assert {k: dict(expert.model_params[1])[k] for k in ("weight", "density", "epsilon")} == {
        "weight": 0.2, "density": 0.2, "epsilon": 0.1}
    assert {k: dict(router.model_params[1])[k] for k in ("weight", "density", "epsilon")} == {
        "weight": 0.8, "density": 0.8, "epsilon": 0.05}
    assert {f.yaml_path: f.tensors for f in plan.filters} == {
        "models[1].parameters.weight[0].filter": 24, "models[1].parameters.density[0].filter": 24,
        "models[1].parameters.epsilon[0].filter": 4, "parameters.lambda[0].filter": 24}


def test_a_recipe_counts_and_refuses_filters_per_document(glm: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    v3, r1 = glm
    soup = {"name": "soup", "merge_method": "linear", "models": [
        {"model": str(m), "parameters": {"weight": 0.5}} for m in (v3, r1)]}
    for pattern, code in ((EXPERTS, 0), ("model.layers.*.mlp.expert.*", 2)):
        final = _chimera(v3, r1, pattern)
        final["models"][0]["model"] = "soup"
        recipe = tmp_path / "recipe.yml"
        recipe.write_text("---\n".join(json.dumps(d) + "\n" for d in (soup, final)))
        assert main(["plan", str(recipe), str(tmp_path / "out"), "--probe-size", "0", "-j", "1"]) == code
        captured = capsys.readouterr()
        if code == 0:
            assert f"models[0].parameters.weight[0].filter '{EXPERTS}': 24 tensor(s)" in captured.out
        else:
            assert f"[document 2] models[0].parameters.weight[0].filter: filter '{pattern}'" in captured.err

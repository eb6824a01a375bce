"""The cells of issue 44's family table that the other files leave open: a glob recipe per tensor class on every MoE
family, and passthrough slices of GLM-4-MoE, gpt-oss and Qwen3-MoE as transformers 5 saves them.

Models: tests/moe_families.py (two layers, four routed experts; per-expert tensors, gpt-oss's fused stacks), two
seeds per family, so every tensor tells its parent. The recipe is TNG's R1T Chimera: the routed experts
(``model.layers.*.mlp.experts.*``, a glob over the whole name: shared experts and routers stay out) from ``b``,
everything else from ``a`` — checked byte for byte, with ``plan --json``'s count of each filter. Slices
``a[0, 2) + b[1, 2)`` must load in transformers with no missing or unexpected key, hold each source layer's tensors
byte for byte, and describe the new stack in config.json (``layer_types``, ``first_k_dense_replace``,
``mlp_only_layers``); a stack GLM-4-MoE's config cannot express (a dense layer after a MoE one) is refused in one
line. Linear, ties and slerp per family: tests/test_moe_families.py; DeepSeek-V3 and Qwen3-Next slices (with their
MTP modules): tests/test_layer_stacks.py; substring filters against mergekit: tests/test_filters.py.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_families import MOE_FAMILIES, make_moe_model
from support import output_tensors, write_config

from resumerge.cli.commands import main

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
# The routed experts of a family (Llama-4 keeps its MoE block under feed_forward).
EXPERTS = {family: f"model.layers.*.{'feed_forward' if family == 'llama4_text' else 'mlp'}.experts.*"
           for family in MOE_FAMILIES}
# Routed-expert tensors per family: 4 experts × 3 projections per MoE layer (DeepSeek-V3 and GLM-4-MoE: layer 1
# only, layer 0 is dense); gpt-oss: 4 fused stacks (gate_up_proj, down_proj and their biases) per layer;
# Llama-4: 2 per layer (no biases).
ROUTED = {"deepseek_v3": 12, "glm4_moe": 12, "qwen3_moe": 24, "qwen3_next": 24, "gpt_oss": 8, "llama4_text": 4}
STACK = ((0, 0), (0, 1), (1, 1))  # (model, source layer) of output layers 0..2 for slices a[0, 2) + b[1, 2)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Path]]]:
    """Two models (seeds 1 and 2) of every MoE family, built once per module."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("family-recipes")
    yield {t: (make_moe_model(root / f"{t}-a", t, 1), make_moe_model(root / f"{t}-b", t, 2)) for t in MOE_FAMILIES}


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _config(directory: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return doc


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_a_glob_chimera_recipe_takes_exactly_the_routed_experts_from_b(
        family: str, pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pairs[family]
    experts = EXPERTS[family]
    cfg = write_config(tmp_path / "chimera.yml", {"merge_method": "linear", "models": [
        {"model": str(a), "parameters": {"weight": [{"filter": experts, "value": 0}, {"value": 1}]}},
        {"model": str(b), "parameters": {"weight": [{"filter": experts, "value": 1}, {"value": 0}]}}]})
    assert main(["plan", str(cfg), "--json", "--probe-size", "0", "-j", "1"]) == 0
    filters = json.loads(capsys.readouterr().out)["filters"]
    assert [(f["yaml_path"], f["pattern"], f["tensors"]) for f in filters] == [
        (f"models[{i}].parameters.weight[0].filter", experts, ROUTED[family]) for i in (0, 1)]
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    merged, ta, tb = output_tensors(out), output_tensors(a), output_tensors(b)
    assert merged.keys() == ta.keys()
    routed = {n for n in merged if fnmatch.fnmatchcase(n, experts)}
    assert len(routed) == ROUTED[family]
    for name, tensor in merged.items():
        parent = tb if name in routed else ta  # shared experts, routers and their biases from a
        assert tensor.dtype == parent[name].dtype and _bytes(tensor) == _bytes(parent[name]), name


def _layer_tensors(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}."
    return {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}


@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss", "qwen3_moe"])
def test_slices_load_with_each_source_layer_and_a_config_for_the_new_stack(
        family: str, pairs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    a, b = pairs[family]
    cfg = write_config(tmp_path / "slices.yml", {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(b), "layer_range": [1, 2]}]}]})
    out = tmp_path / "out"
    assert main(["run", str(cfg), str(out), "--quiet"]) == 0
    got, sources = output_tensors(out), (output_tensors(a), output_tensors(b))
    for i, (model, layer) in enumerate(STACK):
        have, want = _layer_tensors(got, i), _layer_tensors(sources[model], layer)
        assert have.keys() == want.keys(), i
        assert all(_bytes(have[k]) == _bytes(want[k]) for k in want), i
    loose = {n for n in got if not n.startswith("model.layers.")}
    assert loose == {n for n in sources[0] if not n.startswith("model.layers.")}
    for name in loose:  # the embedding from the first slice's model, the final norm and head from the last's
        assert _bytes(got[name]) == _bytes(sources[0 if "embed_tokens" in name else 1][name]), name
    written, source = _config(out), _config(a)
    assert written["num_hidden_layers"] == len(STACK)
    if "layer_types" in source:  # gpt-oss: sliding, full → sliding, full, full
        assert written["layer_types"] == [source["layer_types"][layer] for _, layer in STACK]
    if "first_k_dense_replace" in source:  # GLM-4-MoE: dense layer 0, then MoE layers
        assert written["first_k_dense_replace"] == 1
    if "mlp_only_layers" in source:
        assert written["mlp_only_layers"] == []
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    assert model.config.num_hidden_layers == len(STACK)
    if "layer_types" in source:
        assert model.config.layer_types == written["layer_types"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 2, 77, 127]])).logits).all()


def test_a_glm_moe_stack_with_a_dense_layer_after_a_moe_layer_is_refused_in_one_line(
        pairs: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = pairs["glm4_moe"]
    cfg = write_config(tmp_path / "c.yml", {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": str(a), "layer_range": [1, 2]}]},
        {"sources": [{"model": str(a), "layer_range": [0, 2]}]}]})
    assert main(["run", str(cfg), str(tmp_path / "out"), "--quiet"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert all(part in lines[0] for part in ("slices[1]", "output layer 1 (layer 0 of", "first_k_dense_replace"))
    assert not (tmp_path / "out").exists()

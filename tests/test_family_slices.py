"""Slices of the newest layer stacks write a config.json transformers builds the stack from, or are refused.

Gemma 4, GLM-5, Nemotron-H and LFM2-MoE tiny models (tests/newest_families.py) sliced into a 5-layer stack of 2 + 3
source layers that changes each per-layer pattern: the output's tensors are the source layers' renumbered, byte for
byte; its config.json carries every per-layer fact re-indexed (found from transformers' config class, not from a
list of names) and loads in transformers with no missing, unexpected or mismatched keys, giving the logits of a
model built from the source config with the expected facts written by hand here. Stacks the family's config cannot
describe are refused in one line (exit 2) before anything is written. Before this, the four stacks were written
with exit 0 and a config.json that built another model (or none).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from newest_families import NEWEST, make_newest_model
from safetensors.torch import save_file
from support import api_merge as _merge
from support import output_tensors as _tensors
from support import write_config

from resumerge.cli.commands import main
from resumerge.config.merge_config import load_config_text
from resumerge.config.modelref import ModelRef
from resumerge.inputs.model import ModelInput
from resumerge.merge.plan.architecture import PER_LAYER_KEYS, unsliceable
from resumerge.merge.plan.buildcheck import NOT_BUILT, check_built
from resumerge.merge.plan.layerfacts import per_layer_keys
from resumerge.merge.plan.outconfig import build_out_config

pytest.importorskip("transformers", reason="transformers (a dependency of the mergekit test extra) is needed")
TOKENS = torch.tensor([[1, 5, 9, 2, 77, 127]])
S, F = "sliding_attention", "full_attention"
# family -> (the stack's two layer ranges, the config.json facts the output must have, keys it must not have)
STACKS: dict[str, tuple[tuple[tuple[int, int], ...], dict[str, Any], tuple[str, ...]]] = {
    # layers 0, 1, 2, 2, 3: the last three share keys and values (the source's last two did), layer 4 is full attention
    "gemma4_shared": (((0, 3), (2, 4)),
                      {"num_hidden_layers": 5, "num_kv_shared_layers": 3, "layer_types": [S, F, S, S, F],
                       "per_layer_config": {"1": {"head_dim": 16}, "4": {"head_dim": 16}}}, ()),
    "nemotron_h": (((0, 2), (1, 4)),
                   {"layers_block_type": ["linear_attention", "moe", "moe", "full_attention", "mlp"]},
                   ("num_hidden_layers",)),
    # Nemotron-H as hub configs are written: hybrid_override_pattern (M Mamba, E MoE, * attention, - MLP) and a count
    "nemotron_h-pattern": (((0, 2), (1, 4)), {"hybrid_override_pattern": "MEE*-", "num_hidden_layers": 5},
                           ("layers_block_type",)),
    "glm5": (((0, 2), (1, 4)),
             {"num_hidden_layers": 5, "indexer_types": ["full", "shared", "shared", "full", "shared"],
              "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"], "index_topk_pattern": "FSSFS",
              "layer_types": ["indexed_attention"] * 5},
             ()),
    # GLM-5 whose config.json has no indexer_types (transformers derives them from index_topk_freq: full, shared, full,
    # shared), as hub configs may: the list is written, since the derivation for 5 layers gives other entries
    "glm5-derived": (((0, 2), (1, 4)),
                     {"num_hidden_layers": 5, "indexer_types": ["full", "shared", "shared", "full", "shared"],
                      "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
                      "layer_types": ["indexed_attention"] * 5}, ("index_topk_pattern",)),
    "lfm2_moe": (((0, 2), (1, 4)),
                 {"num_hidden_layers": 5, "num_dense_layers": 3, "layer_types": ["conv", F, F, "conv", F]}, ()),
}
# family -> (a stack its config cannot describe, what the one-line refusal says)
REFUSED = {
    "gemma4": (((0, 2), (0, 3)), ("slices[1]", "output layer 4 (layer 2 of", "layer_types 'sliding_attention'",
                                  "makes it 'full_attention'")),
    "gemma4_shared": (((2, 4), (0, 2)), ("slices[0]", "output layer 0 (layer 2 of", "reuses an earlier layer's keys",
                                         "num_kv_shared_layers")),
    "glm5": (((1, 2), (1, 4)), ("slices[0]", "output layer 0 (layer 1 of", "indexer_types 'shared'")),
    "lfm2_moe": (((2, 4), (0, 2)), ("slices[1]", "output layer 2 (layer 0 of", "num_dense_layers")),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("newest")
    built = {family: make_newest_model(root / family, family, 0) for family in NEWEST}
    built["glm5-derived"] = shutil.copytree(built["glm5"], root / "glm5-derived")
    doc = json.loads((built["glm5-derived"] / "config.json").read_text())
    del doc["indexer_types"], doc["index_topk_pattern"]
    (built["glm5-derived"] / "config.json").write_text(json.dumps({**doc, "index_topk_freq": 2,
                                                                    "index_skip_topk_offset": 1}))
    built["nemotron_h-pattern"] = shutil.copytree(built["nemotron_h"], root / "nemotron_h-pattern")
    doc = json.loads((built["nemotron_h-pattern"] / "config.json").read_text())
    del doc["layers_block_type"]
    (built["nemotron_h-pattern"] / "config.json").write_text(json.dumps({**doc, "hybrid_override_pattern": "ME*-",
                                                                          "num_hidden_layers": 4}))
    yield built


def _slices(model: Path, ranges: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    return {"merge_method": "passthrough", "dtype": "float32",
            "slices": [{"sources": [{"model": str(model), "layer_range": list(r)}]} for r in ranges]}


def _renumbered(source: dict[str, torch.Tensor], layers: list[int], prefix: str) -> dict[str, torch.Tensor]:
    """The source's tensors with output layer ``i`` made of source layer ``layers[i]``."""
    out = {n: t for n, t in source.items() if not n.startswith(prefix)}
    for i, layer in enumerate(layers):
        start = f"{prefix}{layer}."
        out.update({f"{prefix}{i}.{n[len(start):]}": t for n, t in source.items() if n.startswith(start)})
    return out


@pytest.mark.parametrize("family", sorted(STACKS))
def test_a_stack_of_slices_carries_every_per_layer_fact(family: str, models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ranges, facts, absent = STACKS[family]
    source = models[family]
    out = _merge(tmp_path, _slices(source, ranges))
    written = json.loads((out / "config.json").read_text())
    assert {k: written.get(k) for k in facts} == facts
    assert not set(absent) & set(written)
    # byte-equal, renumbered
    layers = [i for start, end in ranges for i in range(start, end)]
    prefix = "backbone.layers." if family.startswith("nemotron_h") else "model.layers."
    assert written["model_type"] == NEWEST[family.split("-")[0]][0]
    expected = _renumbered(_tensors(source), layers, prefix)
    got = _tensors(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # transformers builds the output with every tensor in place, and gives the logits of the stack described by hand
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    by_hand = {**json.loads((source / "config.json").read_text()), **facts}
    (reference_dir / "config.json").write_text(json.dumps(by_hand))
    save_file({n: t.clone() for n, t in expected.items()}, reference_dir / "model.safetensors",
              metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(reference_dir)
    assert type(AutoConfig.from_pretrained(out)) is type(reference.config)
    with torch.no_grad():  # every hidden state asked for: transformers 5.24's Gemma 4 without per-layer inputs
        # otherwise fails in the forward of a model sharing keys and values (its logits_to_keep shortcut)
        got_logits = model(TOKENS, output_hidden_states=True).logits
        torch.testing.assert_close(got_logits, reference(TOKENS, output_hidden_states=True).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_stack_the_family_cannot_describe_is_refused_in_one_line(
    family: str, models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ranges, parts = REFUSED[family]
    cfg = write_config(tmp_path / "c.yml", _slices(models[family.split("-")[0]], ranges))
    for command in (["plan", str(cfg)], ["run", str(cfg), str(tmp_path / "out"), "--quiet"]):
        assert main(command) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        for part in parts:
            assert part in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_gemma4_whole_stack_in_order_is_written_and_its_override_map_is_reindexed(
    models: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    source = models["gemma4"]
    out = _merge(tmp_path, _slices(source, ((0, 2), (2, 4))))  # its own stack, in two slices
    assert _tensors(out).keys() == _tensors(source).keys()
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    # Gemma 4's per-layer override map (head_dim of the full-attention layers) follows the layers it describes
    doc = json.loads((source / "config.json").read_text())
    assert doc["per_layer_config"] == {"1": {"head_dim": 16}, "3": {"head_dim": 16}}
    models_in = {"a": ModelInput(ModelRef("a"), source, doc, {}, ())}
    config = load_config_text(yaml.safe_dump(_slices(Path("a"), ((0, 2), (1, 4)))))
    written = build_out_config(config, models_in, "a", (("a", 0), ("a", 1), ("a", 1), ("a", 2), ("a", 3)), {})
    assert written["per_layer_config"] == {"1": {"head_dim": 16}, "2": {"head_dim": 16}, "4": {"head_dim": 16}}
    assert written["layer_types"] == [S, F, F, S, F] and written["num_hidden_layers"] == 5


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_every_per_layer_list_of_every_causal_lm_config_is_found() -> None:
    # The lists of each family's default config whose length follows the layer count (built here with 3 and 6
    # layers: other counts than the finder's) must all be found in a config.json holding them. A new family
    # whose config adds such a list fails here until slices re-index it.
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging

    logging.set_verbosity_error()
    missed = {}
    for model_type in _causal_lm_types():
        docs = []
        for count in (3, 6):
            try:
                built = CONFIG_MAPPING[model_type](num_hidden_layers=count)
                docs.append((built.to_dict(), built.num_hidden_layers))
            except Exception:
                break
        if len(docs) < 2 or docs[0][1] == docs[1][1]:
            continue
        (small, n), (large, m) = docs
        lists = {k for k, v in large.items() if isinstance(v, list) and len(v) == m and v != list(range(m))
                 and isinstance(small.get(k), list) and len(small[k]) == n}
        left = lists - set(per_layer_keys(large))
        if left:
            missed[model_type] = sorted(left)
        elif lists and unsliceable(small) is None:  # and a stack of 4 made of layers 0, 0, 1, 2 carries each
            # list's entries in that order (a family whose layers no slice may move is refused: tests/test_census.py)
            stack = (0, 0, 1, 2)  # (dense layers first, as dense-prefix families require)
            written = _out_config(small, stack)
            wrong = sorted(k for k in lists if written.get(k) != [small[k][i] for i in stack])
            if wrong:
                missed[model_type] = wrong
    assert missed == {}
    assert {"indexer_types", "mlp_layer_types", "layer_types"} <= set(per_layer_keys(
        {**NEWEST["glm5"][1], "model_type": "glm_moe_dsa", "indexer_types": ["full"] * 4,
         "mlp_layer_types": ["dense"] * 4, "layer_types": ["indexed_attention"] * 4}))


def test_transformers_is_asked_for_per_layer_keys_only_where_the_config_holds_a_list_it_could_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Llama's config holds no list of the layer count's length beside those resumerge names: the keys are known
    # without importing transformers (seconds of a plan's start). Another list of that length is the class's to
    # judge, and its answer is found once per family.
    from resumerge.merge.plan import layerfacts

    asked: list[object] = []
    answer = layerfacts.class_per_layer_keys
    monkeypatch.setattr(layerfacts, "class_per_layer_keys", lambda t: asked.append(t) or answer(t))
    llama = {"model_type": "llama", "num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "eos_token_id": [1, 2]}
    assert per_layer_keys(llama) == ("no_rope_layers",) and asked == []
    lfm2 = {"model_type": "lfm2", "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}
    assert per_layer_keys(lfm2) == ("layer_types",) and asked == []  # a name resumerge keeps
    other = {**llama, "eos_token_id": [1, 2, 3]}  # as long as the stack: transformers says it is not per layer
    assert per_layer_keys(other) == ("no_rope_layers",) and asked == ["llama"]
    layerfacts._class_keys.cache_clear()
    assert answer("llama") == answer("llama") and layerfacts._class_keys.cache_info().misses == 1


def _out_config(doc: dict[str, Any], stack: tuple[int, ...]) -> dict[str, Any]:
    """The output config.json of a passthrough stack of ``doc``'s layers ``stack`` (one model, "a")."""
    models_in = {"a": ModelInput(ModelRef("a"), Path("a"), doc, {}, ())}
    config = load_config_text(yaml.safe_dump(_slices(Path("a"), tuple((i, i + 1) for i in stack))))
    return build_out_config(config, models_in, "a", tuple(("a", i) for i in stack), {})


def test_without_transformers_the_lists_are_reindexed_and_the_build_check_says_it_did_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "no_rope_layers": [1, 0], "eos_token_id": [1, 2]}
    assert per_layer_keys(cfg) == ("no_rope_layers",)
    assert check_built(cfg, {"a": cfg}, "a", (("a", 1), ("a", 0)), {}, lambda i: "slices") == [NOT_BUILT]
    assert check_built(cfg, {"a": cfg}, "a", (("a", 0), ("a", 1)), {}, lambda i: "slices") == []
    assert "no_rope_layers" in PER_LAYER_KEYS
    # the lists resumerge names are re-indexed still: Nemotron-H's (whose length is its count) and GLM-5's
    nemotron = {"model_type": "nemotron_h", "layers_block_type": ["mamba", "moe", "attention", "mlp"]}
    written = _out_config(nemotron, (0, 1, 1, 2, 3))
    assert written["layers_block_type"] == ["mamba", "moe", "moe", "attention", "mlp"]
    assert "num_hidden_layers" not in written
    glm = {"model_type": "glm_moe_dsa", "num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]}
    assert _out_config(glm, (0, 1, 1, 2, 3))["indexer_types"] == ["full", "shared", "shared", "full", "shared"]

"""Fused expert stacks of families the layout table does not hold are found from transformers' modules.

Granite 4 (``granitemoehybrid``: ``block_sparse_moe.input_linear`` / ``output_linear`` on disk, which transformers
renames to its experts module's ``gate_up_proj`` / ``down_proj`` on load) and Mistral 4 (``mlp.experts.gate_up_proj``
/ ``down_proj`` stored fused), tiny models from transformers' own config and init saved by ``save_pretrained``, each
at the ambiguous shape (hidden size twice the expert width: an expert's gate-and-up slice is square). Beside each
stack the test stores each expert's gate, up and down projections alone (cut by the test's own reading of the
families' experts classes: ``linear(x, gate_up[e]).chunk(2, dim=-1)``, gate's rows then up's); TIES makes both, and
every projection of every expert of the fused output has the bytes of its per-expert twin's. Before, Granite 4's
stacks were merged whole by TIES (its experts ranked together) and Mistral 4's were refused ("whose layout resumerge
does not know"); Hunyuan v4's gate and up were ranked together (its forward splits them in ``_apply_gate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from resumerge import api

pytest.importorskip("transformers")

EXPERTS, WIDTH, HIDDEN = 4, 16, 32
GRANITE4: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": HIDDEN, "intermediate_size": WIDTH, "num_hidden_layers": 2,
    "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 8,
    "shared_intermediate_size": WIDTH,
}
MISTRAL4: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": HIDDEN, "intermediate_size": 48, "moe_intermediate_size": WIDTH,
    "num_hidden_layers": 2, "n_routed_experts": EXPERTS, "num_experts_per_tok": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
# Hunyuan v4: its experts' forward splits gate and up in a method of its own (``self._apply_gate``)
HY_V4: dict[str, Any] = {
    **{k: MISTRAL4[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                                "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "num_attention_heads",
                                "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                "qk_nope_head_dim", "v_head_dim")},
    "head_dim": 16, "hc_mult": 2, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2,
}
# family -> (config, its stored input and output projection stacks within a layer)
FAMILIES = {
    "hy_v4": (HY_V4, "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    "granitemoehybrid": (GRANITE4, "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"),
    "mistral4": (MISTRAL4, "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
}


def _model(directory: Path, family: str, seed: int) -> Path:
    """A tiny ``family`` model saved by transformers, with each expert's projections stored alone beside its stacks
    (``….twin.E.gate``, ``up``, ``down``)."""
    from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM

    config, gate_up, down = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = CONFIG_MAPPING[family](**config)
    try:
        model = AutoModelForCausalLM.from_config(cfg)
    except ValueError:  # Mistral 4 has no causal-LM class of its own
        model = AutoModel.from_config(cfg)
    model.save_pretrained(directory)
    (shard,) = directory.glob("*.safetensors")
    tensors = load_file(str(shard))
    for name in [n for n in tensors if n.endswith(gate_up)]:
        layer = name[: -len(gate_up)]
        for e in range(EXPERTS):
            both, out = tensors[name][e], tensors[layer + down][e]
            tensors |= {f"{layer}twin.{e}.gate": both[:WIDTH].clone(), f"{layer}twin.{e}.up": both[WIDTH:].clone(),
                        f"{layer}twin.{e}.down": out.clone()}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ties_merges_each_expert_projection_of_a_stack_found_from_the_modules(family: str, tmp_path: Path) -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    models = [_model(tmp_path / f"m{i}", family, i) for i in range(3)]
    doc = {"merge_method": "ties", "base_model": str(models[0]), "dtype": "float32",
           "models": [{"model": str(m), "parameters": {"weight": 0.5, "density": 0.5}} for m in models]}
    api.run(yaml.safe_dump(doc, sort_keys=False), tmp_path / "out", settings=api.Settings(state_dir=tmp_path / "state"))
    (shard,) = (tmp_path / "out").glob("*.safetensors")
    out = load_file(str(shard))
    _, gate_up, down = FAMILIES[family]
    stacks = [n for n in out if n.endswith(gate_up)]
    assert stacks
    for name in stacks:
        layer = name[: -len(gate_up)]
        for e in range(EXPERTS):
            assert torch.equal(out[name][e][:WIDTH], out[f"{layer}twin.{e}.gate"]), (name, e)
            assert torch.equal(out[name][e][WIDTH:], out[f"{layer}twin.{e}.up"]), (name, e)
            assert torch.equal(out[layer + down][e], out[f"{layer}twin.{e}.down"]), (name, e)

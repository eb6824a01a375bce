"""Tiny models of the newest layer stacks from transformers 5.24 configs: Gemma 4 (per-layer embeddings, a
per-layer override map, sliding/full layers; and one without per-layer embeddings whose last layers share keys and
values), GLM-5 (``glm_moe_dsa``: ``indexer_types``, ``mlp_layer_types``),
Nemotron-H (``layers_block_type`` with no layer count), LFM2 and LFM2-MoE (``num_dense_layers``, conv/attention
``layer_types``, a final norm named ``embedding_norm``) and DeepSeek-V3.2 (an indexer that sees the padding). Each
has four layers whose per-layer facts differ, so that a stack of slices changes every pattern; built by
transformers' own init and saved by ``save_pretrained``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from support import perturb_vectors

H, V = 32, 128
GEMMA4: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16, "vocab_size_per_layer_input": V,
    "hidden_size_per_layer_input": 8, "sliding_window": 16, "max_position_embeddings": 64,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
# Gemma 4 without per-layer embeddings (as the 31B model) and with its last two layers sharing keys and values
GEMMA4_SHARED: Mapping[str, Any] = {**GEMMA4, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 2}
GLM5: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
    "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8, "index_head_dim": 8,
    "index_n_heads": 2, "index_topk": 4, "max_position_embeddings": 64, "index_topk_pattern": "FSFS",
}
NEMOTRON_H: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48,
    "layers_block_type": ["mamba", "moe", "attention", "mlp"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "mamba_num_heads": 4, "mamba_head_dim": 8,
    "ssm_state_size": 8, "n_groups": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16, "max_position_embeddings": 64, "use_mamba_kernels": False,
}
LFM2_MOE: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
    "num_dense_layers": 2, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    "max_position_embeddings": 64,
}
LFM2: Mapping[str, Any] = {key: value for key, value in LFM2_MOE.items()
                            if key not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                           "num_dense_layers")}
# GLM-5 with dense MLPs only (measure refuses a mixture of experts), its indexers still shared every other layer
GLM5_DENSE: Mapping[str, Any] = {**GLM5, "first_k_dense_replace": 4, "n_routed_experts": 0, "n_shared_experts": 0}
# DeepSeek-V3.2: GLM-5's sparse attention without the shared indexers (every layer picks its own top-k keys)
DEEPSEEK_V32: Mapping[str, Any] = {key: value for key, value in GLM5.items() if key != "index_topk_pattern"}
# Phi-2 (``phi``): not new, but its final norm is ``model.final_layernorm``, a name outside the list check once had
PHI: Mapping[str, Any] = {"vocab_size": V, "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": 4,
                          "num_attention_heads": 4, "max_position_embeddings": 64}
NEWEST: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "gemma4": ("gemma4_text", GEMMA4), "gemma4_shared": ("gemma4_text", GEMMA4_SHARED),
    "glm5": ("glm_moe_dsa", GLM5), "glm5_dense": ("glm_moe_dsa", GLM5_DENSE), "nemotron_h": ("nemotron_h", NEMOTRON_H),
    "lfm2_moe": ("lfm2_moe", LFM2_MOE), "lfm2": ("lfm2", LFM2), "deepseek_v32": ("deepseek_v32", DEEPSEEK_V32),
    "phi": ("phi", PHI),
}


def make_newest_model(directory: Path, family: str, seed: int) -> Path:
    """Save a random tiny ``family`` model (weights drawn under ``seed``, norms perturbed too) into ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, config = NEWEST[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    perturb_vectors(model, seed)
    model.save_pretrained(directory)
    return directory

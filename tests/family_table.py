"""Tiny models of the families of issue 69's table that tests/newest_families.py does not hold: Qwen3.5 (and its
MoE), Gemma 4's MoE, GLM-4.7-Flash (``glm4_moe_lite``), Kimi-Linear, OLMo 3, Granite 4 (hybrid MoE), SmolLM3 (no-RoPE
layers) and Mistral 4 (no causal-LM class in transformers 5.24: its base model), each of two layers whose per-layer
facts differ, from transformers' own config and init, saved by ``save_pretrained``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from newest_families import NEWEST
from support import perturb_vectors

H, V = 32, 128
_COMMON: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
}
_TOKENS: Mapping[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_LINEAR_ATTENTION: Mapping[str, Any] = {
    "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
}
_MLA: Mapping[str, Any] = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 8,
                           "qk_nope_head_dim": 8, "num_key_value_heads": 4}
TABLE: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "qwen3_5": ("qwen3_5_text", {**_COMMON, **_LINEAR_ATTENTION}),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_COMMON, **_LINEAR_ATTENTION, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}),
    "gemma4_moe": ("gemma4_text", {**_COMMON, "global_head_dim": 16, "hidden_size_per_layer_input": 0,
                                   "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                                   "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                   "moe_intermediate_size": 16}),
    "glm4_moe_lite": ("glm4_moe_lite", {**_COMMON, **_MLA, "moe_intermediate_size": 16, "n_routed_experts": 4,
                                        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
                                        "topk_group": 1, "first_k_dense_replace": 1}),
    "kimi_linear": ("kimi_linear", {**_COMMON, **_MLA, **_TOKENS, "moe_intermediate_size": 16, "num_experts": 4,
                                    "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                                    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 8,
                                                           "num_heads": 4, "short_conv_kernel_size": 4}}),
    "olmo3": ("olmo3", {**_COMMON, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    "granite4": ("granitemoehybrid", {**_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2,
                                      "layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_head": 8,
                                      "mamba_d_state": 8, "shared_intermediate_size": 16, "intermediate_size": 16}),
    "smollm3": ("smollm3", {**_COMMON, **_TOKENS, "no_rope_layers": [1, 0]}),
    "mistral4": ("mistral4", {**_COMMON, **_MLA, "moe_intermediate_size": 16, "n_routed_experts": 4,
                              "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16, "head_dim": 16}),
}


def make_table_model(directory: Path, family: str, seed: int) -> Path:
    """Save a random tiny ``family`` model (of :data:`TABLE`, else of tests/newest_families.py) into ``directory``
    (weights drawn under ``seed``, norms perturbed too)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    model_type, config = TABLE[family] if family in TABLE else NEWEST[family]
    torch.manual_seed(seed)
    built = AutoConfig.for_model(model_type, **config)
    try:
        model = AutoModelForCausalLM.from_config(built)
    except ValueError:  # Mistral 4: no causal-LM class of its own
        model = AutoModel.from_config(built)
    perturb_vectors(model, seed)
    model.save_pretrained(directory)
    return directory

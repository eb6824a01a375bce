"""Tiny real models of the MoE families of 2025–2026, generated with transformers 5 (a test-only dependency).

Two layers each, hidden 32, four routed experts of width 12 (so 2·I ≠ H: a fused layout is told from the config,
not guessed), vocabulary 128, saved with ``save_pretrained`` as transformers writes them: DeepSeek-V3 (dense layer
0, MLA attention, a shared expert; no MTP layer — see the MTP tests for that), GLM-4-MoE (dense layer 0, a shared
expert, the router's ``e_score_correction_bias``), Qwen3-MoE, Qwen3-Next (a linear-attention layer then a full one)
store their experts one by one; gpt-oss stores fused stacks (gate and up interleaved, biases). Every parameter is
perturbed under the seed, so the models of two seeds differ in every tensor and no tensor holds a constant.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

_COMMON = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 0, "intermediate_size": 48}
_ROUTED = {"num_experts_per_tok": 2, "moe_intermediate_size": 12}
_DEEPSEEK_STYLE = {**_ROUTED, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                   "n_group": 1, "topk_group": 1}
MOE_FAMILIES: Mapping[str, Mapping[str, Any]] = {  # model_type: its tiny config
    "deepseek_v3": {**_DEEPSEEK_STYLE, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 8},
    "glm4_moe": {**_DEEPSEEK_STYLE, "head_dim": 8},
    "qwen3_moe": {**_ROUTED, "head_dim": 8, "num_experts": 4},
    "qwen3_next": {**_ROUTED, "head_dim": 8, "num_experts": 4, "shared_expert_intermediate_size": 12,
                   "layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 2,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
    "gpt_oss": {"head_dim": 8, "intermediate_size": 12, "num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
    # Llama-4 text: every layer MoE, fused stacks with gate and up side by side (not interleaved), a shared expert.
    "llama4_text": {"head_dim": 8, "intermediate_size": 12, "intermediate_size_mlp": 48, "num_local_experts": 4,
                    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1},
}


def make_moe_model(directory: Path, model_type: str, seed: int) -> Path:
    """Save a random tiny ``model_type`` model of :data:`MOE_FAMILIES` (weights drawn under ``seed``) in
    ``directory``, as transformers writes it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**_COMMON, **MOE_FAMILIES[model_type]})
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    return directory

"""Tiny models of the 2025–2026 layer stacks from transformers 5.24 configs, with the MTP tensors checkpoints have.

transformers builds DeepSeek-V3 and Qwen3-Next without their multi-token-prediction modules (it ignores them on
load), so they are added here by hand with the names and shapes of the released checkpoints
(``architectures-2026.md`` §2): DeepSeek-V3's layer ``num_hidden_layers`` (a MoE decoder layer plus ``enorm``,
``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.{norm,head}`` and a stored copy of ``embed_tokens``) and Qwen3-Next's
top-level ``mtp.*`` (``fc`` [H, 2H], ``pre_fc_norm_{embedding,hidden}``, ``norm`` and one full-attention decoder
layer ``mtp.layers.0``). With ``mtp_like_last`` the MTP decoder layer is a copy of the model's last layer (its
extras stay random), so a test can see that the MTP layer is merged exactly as that layer is. Llama-4 text has
MoE layers 1 and 3 of 4 (``interleave_moe_layer_step`` 2), so a stack that moves them shows ``moe_layers``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from support import perturb_vectors

H, V = 32, 128
DEEPSEEK: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
    "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8, "max_position_embeddings": 64,
}
QWEN3_NEXT: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "max_position_embeddings": 64,
}
LLAMA4: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": H, "intermediate_size": 48, "intermediate_size_mlp": 40, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 2,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "max_position_embeddings": 64,
    "attention_chunk_size": 16,
}
FAMILIES: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "deepseek_v3": ("deepseek_v3", DEEPSEEK), "qwen3_next": ("qwen3_next", QWEN3_NEXT),
    "llama4": ("llama4_text", LLAMA4),
}


def make_stack_model(directory: Path, family: str, seed: int, *, mtp: bool = True,
                     mtp_like_last: bool = False) -> Path:
    """Save a random tiny ``family`` model (weights drawn under ``seed``; norms perturbed too) into ``directory``,
    with its MTP module when ``mtp`` (DeepSeek-V3, Qwen3-Next)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, config = FAMILIES[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    perturb_vectors(model, seed)
    model.save_pretrained(directory)
    if mtp and family in ("deepseek_v3", "qwen3_next"):
        path = directory / "model.safetensors"
        tensors = load_file(path)
        tensors.update(_mtp_tensors(family, tensors, torch.Generator().manual_seed(seed + 2000),
                                    like_last=mtp_like_last))
        save_file(tensors, path, metadata={"format": "pt"})
    return directory


def make_variant(source: Path, directory: Path, family: str, seed: int) -> Path:
    """A second model of ``source``'s family without building one: every tensor plus noise drawn under ``seed``,
    the copies :func:`make_stack_model` made (MTP decoder layer, stored embedding and head) made again."""
    shutil.copytree(source, directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    noisy = {n: t + 0.02 * torch.randn(t.shape, generator=generator) for n, t in sorted(tensors.items())}
    layers = int(FAMILIES[family][1]["num_hidden_layers"])
    where = f"model.layers.{layers}." if family == "deepseek_v3" else "mtp.layers.0."
    copies = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
    for name in noisy:
        if name.startswith(where):
            suffix = name[len(where):]
            original = copies.get(suffix, f"model.layers.{layers - 1}.{suffix}")
            if original in tensors and torch.equal(tensors[name], tensors[original]):
                noisy[name] = noisy[original].clone()
    save_file(noisy, path, metadata={"format": "pt"})
    return directory


def _mtp_tensors(family: str, tensors: dict[str, torch.Tensor], generator: torch.Generator, *,
                 like_last: bool) -> dict[str, torch.Tensor]:
    layers = int(FAMILIES[family][1]["num_hidden_layers"])
    last = f"model.layers.{layers - 1}."
    where = f"model.layers.{layers}." if family == "deepseek_v3" else "mtp.layers.0."

    def rand(*shape: int) -> torch.Tensor:
        return 0.1 * torch.randn(*shape, generator=generator)

    out = {where + n[len(last):]: (t.clone() if like_last else rand(*t.shape)).to(t.dtype)
           for n, t in tensors.items() if n.startswith(last)}
    if family == "deepseek_v3":
        out.update({where + "enorm.weight": 1 + rand(H), where + "hnorm.weight": 1 + rand(H),
                    where + "eh_proj.weight": rand(H, 2 * H), where + "shared_head.norm.weight": 1 + rand(H),
                    where + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                    where + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    else:
        out.update({"mtp.fc.weight": rand(H, 2 * H), "mtp.norm.weight": rand(H),
                    "mtp.pre_fc_norm_embedding.weight": rand(H), "mtp.pre_fc_norm_hidden.weight": rand(H)})
    return out


def mtp_names(names: Iterable[str], family: str, layers: int | None = None) -> set[str]:
    """The MTP tensors among ``names`` of a ``family`` model with ``layers`` decoder layers (default: the
    family's tiny model's)."""
    count = layers if layers is not None else int(FAMILIES[family][1]["num_hidden_layers"])
    return {n for n in names
            if n.startswith("mtp.") or (family == "deepseek_v3" and n.startswith(f"model.layers.{count}."))}


def config_of(directory: Path) -> dict[str, Any]:
    """The config.json of the model or output at ``directory``."""
    found: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return found


def without_mtp(source: Path, directory: Path, family: str) -> Path:
    """A copy of the model at ``source`` without its MTP tensors (config.json kept: as transformers saves them)."""
    shutil.copytree(source, directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    save_file({n: t for n, t in tensors.items() if n not in mtp_names(tensors, family)}, path,
              metadata={"format": "pt"})
    return directory

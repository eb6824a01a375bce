"""Tiny DeepSeek-V4 and Hunyuan v4 (``hy_v4``) models of transformers 5.24: built by transformers' own config and
init and saved by ``save_pretrained`` (DeepSeek-V4's head then is ``head.weight``, which its conversion maps to
``lm_head``), and DeepSeek-V4 in the layout deepseek-ai ships it (DeepSeek-V4-Flash): its own tensor names
(``embed.weight``, ``layers.N.attn.wq_a.weight``, ``hc_head_fn``), the published config.json keys
(``compress_ratios``, ``num_hash_layers``, ``expert_dtype: fp4``, ``quantization_config`` fp8 with ``scale_fmt:
ue8m0``), the linears FP8 E4M3 in 128×128 blocks and the routed experts FP4 E2M1 (two codes a byte, I8) with one
power of two per 32 inputs, every scale F8_E8M0 named ``X.scale`` beside ``X.weight``; the hash-routing tables
``tid2eid`` I64; its multi-token-prediction module ``mtp.0.*``. The quantization here is the test's own, written
from the published format (not resumerge's)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from support import perturb_vectors

V = 128
# Four layers of every kind: sliding, compressed-sparse (ratio 4) and heavily compressed (ratio 128) attention, the
# first two hash-routed; widths multiples of 32 (FP4 groups 32 inputs)
DEEPSEEK_V4: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": 32, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "q_lora_rank": 24, "num_experts_per_tok": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "max_position_embeddings": 64, "hc_mult": 2,
    "hc_sinkhorn_iters": 3, "sliding_window": 8, "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2,
    "index_head_dim": 8, "index_topk": 4, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 2,
    "qk_rope_head_dim": 8,
}
HY_V4: Mapping[str, Any] = {
    "vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "q_lora_rank": 24, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "num_experts_per_tok": 2, "n_routed_experts": 4,
    "n_shared_experts": 1, "max_position_embeddings": 64, "hc_mult": 2, "index_n_heads": 2, "index_head_dim": 8,
    "index_topk": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
FAMILIES: Mapping[str, tuple[str, Mapping[str, Any]]] = {"deepseek_v4": ("deepseek_v4", DEEPSEEK_V4),
                                                         "hy_v4": ("hy_v4", HY_V4)}
# The published config's quantization (DeepSeek-V4-Flash config.json)
QUANTIZATION: Mapping[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# the linears stored FP8 (every other 2-D weight, the embeddings, head, router and norms, stays as it is)
_FP8 = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".compressor.wkv.",
        ".compressor.wgate.", ".indexer.wq_b.", ".shared_experts.")


def make_v4_model(directory: Path, family: str, seed: int, *, tables: int = 0) -> Path:
    """Save a random tiny ``family`` model (of :data:`FAMILIES`) as transformers saves it into ``directory``:
    weights drawn under ``seed``, norms perturbed too; DeepSeek-V4's hash-routing tables drawn under ``tables``
    (equal in two models of one ``tables``, as fine-tunes of one base)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, config = FAMILIES[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    perturb_vectors(model, seed)
    generator = torch.Generator().manual_seed(tables)
    for name, buffer in model.named_buffers():
        if name.endswith("tid2eid"):
            count = model.config.n_routed_experts
            buffer.copy_(torch.stack([torch.randperm(count, generator=generator)[:buffer.shape[1]]
                                      for _ in range(buffer.shape[0])]))
    model.save_pretrained(directory)
    return directory


def shipped_name(name: str) -> str:
    """A DeepSeek-V4 tensor's name in deepseek-ai's checkpoint, from the name transformers saves it under."""
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    return name.replace("hc_head.hc_", "hc_head_") if name.startswith("hc_head.") else name


def make_shipped_v4(directory: Path, seed: int, *, tables: int = 0) -> Path:
    """A tiny DeepSeek-V4 in deepseek-ai's shipped layout (module docstring) in ``directory``; weights drawn under
    ``seed``, hash-routing tables under ``tables``."""
    from safetensors.torch import load_file, save_file

    plain = make_v4_model(directory.with_name(directory.name + "-plain"), "deepseek_v4", seed, tables=tables)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(plain / "model.safetensors")).items():
        name = shipped_name(name)
        if ".experts." in name and ".shared_experts." not in name:
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = fp4_encode(tensor)
        elif name.endswith(".weight") and any(part in name for part in _FP8):
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = fp8_encode(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() and tensor.dim() == 2 else tensor
    _add_mtp(tensors, seed)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((plain / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor",
                "dtype"):
        doc.pop(key, None)
    doc.update({"compress_ratios": [*DEEPSEEK_V4["compress_ratios"], 0], "num_hash_layers": 2,
                "qk_rope_head_dim": 8, "expert_dtype": "fp4", "quantization_config": dict(QUANTIZATION),
                "torch_dtype": "bfloat16"})
    (directory / "config.json").write_text(json.dumps(doc, indent=2))
    return directory


def _add_mtp(tensors: dict[str, torch.Tensor], seed: int) -> None:
    """The multi-token-prediction module (``num_nextn_predict_layers: 1``) the shipped checkpoint holds beside its
    layers as ``mtp.0.*`` (which transformers does not load): a layer like the last one, with its own input norms
    and projections (FP8) and hyper-connection head."""
    generator = torch.Generator().manual_seed(seed + 2000)
    last = f"layers.{DEEPSEEK_V4['num_hidden_layers'] - 1}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors["mtp.0." + name.removeprefix(last)] = tensors[name].clone()
    for name in ("e_proj", "h_proj"):
        tensors[f"mtp.0.{name}.weight"], tensors[f"mtp.0.{name}.scale"] = fp8_encode(
            0.02 * torch.randn(32, 32, generator=generator))
    for name in ("enorm", "hnorm", "norm"):
        tensors[f"mtp.0.{name}.weight"] = 1 + 0.05 * torch.randn(32, generator=generator)
    for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
        tensors[f"mtp.0.{name}"] = tensors[name].clone()


def _power_of_two_at_least(value: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(value)))


def fp8_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes and one ue8m0 scale per 128×128 block (``amax / 448`` rounded up to a power of two)."""
    rows, cols = weight.shape
    grid = (-(-rows // 128), -(-cols // 128))
    scales = torch.empty(grid)
    codes = torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            scale = _power_of_two_at_least(block.abs().max().clamp(min=1e-30) / 448.0)
            scales[i, j] = scale
            codes[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale).clamp(-448, 448)
    return codes.to(torch.float8_e4m3fn), scales.to(torch.float8_e8m0fnu)


def fp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 E2M1 codes, two a byte (the even input in the low nibble), as I8, and one power of two per 32 inputs of
    a row (``2^(floor(log2 amax) − 2)``), F8_E8M0."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-30)
    scales = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    scaled = groups / scales.unsqueeze(-1)
    values = torch.tensor(E2M1)
    codes = (scaled.unsqueeze(-1) - values).abs().argmin(dim=-1).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scales.to(torch.float8_e8m0fnu)


def fp4_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`fp4_encode`'s codes and scales."""
    data = packed.view(torch.uint8).long()
    values = torch.tensor(E2M1)
    pairs = torch.stack([values[data & 0xF], values[data >> 4]], dim=-1).reshape(packed.shape[0], -1)
    return (pairs.reshape(packed.shape[0], -1, 32) * scales.float().unsqueeze(-1)).reshape(pairs.shape)

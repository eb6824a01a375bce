"""Tiny multimodal models (VLMs) of the families people merge, generated with transformers (test-only).

Each :class:`Vlm` builds a ``…ForConditionalGeneration`` with a 2-layer language model (hidden 32, vocab 64) and
a 2-layer vision tower, weights drawn under a seed (norms perturbed too, so two seeds differ everywhere), saved
with ``save_pretrained`` in one of three tensor-name layouts:

- ``saved``: as transformers 5 writes it (``language_model.model.layers.N``, ``vision_tower.encoder.layers.N``);
- ``hub``: Llava and Gemma 3 as their hub checkpoints name them (``vision_tower.vision_model.encoder.*``);
- ``memory``: transformers 5's in-memory names (``model.language_model.layers.N``, ``lm_head.weight``), the only
  Llava layout mergekit 0.1.5 merges completely.

transformers loads all three. ``inputs`` gives a dummy image + text batch the family's forward accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from support import perturb_vectors

TEXT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "head_dim": 8,
        "bos_token_id": 1, "eos_token_id": 2}
# Llama 4's language model: 4 layers, MoE on layers 1 and 3 (a routed expert of 2 and the shared one), layer 3
# without rotary embeddings (NoPE, full attention, temperature-tuned queries), the others chunked by 4 tokens.
LLAMA4_TEXT = {**TEXT, "num_hidden_layers": 4, "intermediate_size": 12, "intermediate_size_mlp": 40,
               "num_local_experts": 2, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
               "no_rope_layer_interval": 4, "attention_chunk_size": 4, "floor_scale": 4, "attn_scale": 0.5}
_IMAGE_TOKEN = 63
_MROPE = {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
_VISION = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2}


@dataclass(frozen=True)
class Vlm:
    """One VLM family: its transformers classes' names, config, and the hub relabelling (old → new prefix)."""

    name: str
    model_class: str
    config_class: str
    config: Mapping[str, Any]
    hub_prefixes: tuple[tuple[str, str], ...] = ()
    hub_transposed: tuple[str, ...] = ()  # name endings of the tensors the hub stores with dims 1 and 2 swapped


VLMS: tuple[Vlm, ...] = (
    Vlm("llava", "LlavaForConditionalGeneration", "LlavaConfig", {
        "text_config": {"model_type": "llama", **TEXT},
        "vision_config": {"model_type": "clip_vision_model", **_VISION, "image_size": 16, "patch_size": 8,
                          "projection_dim": 16},
        "image_token_index": _IMAGE_TOKEN, "vision_feature_layer": -1, "image_seq_length": 4},
        hub_prefixes=(("vision_tower.", "vision_tower.vision_model."),)),
    Vlm("gemma3", "Gemma3ForConditionalGeneration", "Gemma3Config", {
        "text_config": {"model_type": "gemma3_text", **TEXT, "sliding_window": 16},
        "vision_config": {"model_type": "siglip_vision_model", **_VISION, "image_size": 16, "patch_size": 8,
                          "vision_use_head": False},
        "mm_tokens_per_image": 4, "image_token_index": _IMAGE_TOKEN, "boi_token_index": 61, "eoi_token_index": 62},
        hub_prefixes=(("vision_tower.", "vision_tower.vision_model."),)),
    Vlm("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig", {
        "text_config": {**TEXT, **_MROPE},
        "vision_config": {"depth": 2, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                          "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2},
        "image_token_id": _IMAGE_TOKEN, "video_token_id": 62, "vision_start_token_id": 61}),
    Vlm("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", {
        "text_config": {**TEXT, **_MROPE},
        "vision_config": {"depth": 2, "hidden_size": 16, "intermediate_size": 24, "out_hidden_size": 32,
                          "num_heads": 2, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
                          "window_size": 16, "fullatt_block_indexes": [1]},
        "image_token_id": _IMAGE_TOKEN, "video_token_id": 62, "vision_start_token_id": 61}),
    Vlm("mistral3", "Mistral3ForConditionalGeneration", "Mistral3Config", {
        "text_config": {"model_type": "mistral", **TEXT},
        "vision_config": {"model_type": "pixtral", **_VISION, "image_size": 16, "patch_size": 4, "head_dim": 8},
        "image_token_index": _IMAGE_TOKEN, "spatial_merge_size": 2}),
    Vlm("idefics3", "Idefics3ForConditionalGeneration", "Idefics3Config", {
        "text_config": {"model_type": "llama", **TEXT},
        "vision_config": {**_VISION, "image_size": 16, "patch_size": 4},
        "image_token_id": _IMAGE_TOKEN, "scale_factor": 2}),
)


# Multimodal MoE families, run by check's parity tests (the text part) and not by the merge tests of VLMS.
MOE_VLMS: tuple[Vlm, ...] = (
    Vlm("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", {
        "text_config": {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [1, 1, 2], "mrope_interleaved": True},
                        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
                        "decoder_sparse_step": 2, "tie_word_embeddings": False},
        "vision_config": {"depth": 2, "hidden_size": 16, "intermediate_size": 24, "out_hidden_size": 32,
                          "num_heads": 2, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
                          "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        "image_token_id": _IMAGE_TOKEN, "video_token_id": 62, "vision_start_token_id": 61,
        "vision_end_token_id": 60}, hub_transposed=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    Vlm("llama4", "Llama4ForConditionalGeneration", "Llama4Config", {
        "text_config": {"model_type": "llama4_text", **LLAMA4_TEXT},
        "vision_config": {**_VISION, "image_size": 16, "patch_size": 4, "vision_output_dim": 16,
                          "projector_input_dim": 32, "projector_output_dim": 32, "pixel_shuffle_ratio": 0.5},
        "image_token_index": _IMAGE_TOKEN, "boi_token_index": 61, "eoi_token_index": 62}),
)


def vlm(name: str) -> Vlm:
    """The family called ``name``."""
    return next(v for v in (*VLMS, *MOE_VLMS) if v.name == name)


def model_class(family: Vlm) -> Any:
    """The family's transformers model class."""
    import transformers

    return getattr(transformers, family.model_class)


def make_vlm(directory: Path, family: Vlm, seed: int, layout: str = "saved") -> Path:
    """Save a random ``family`` model drawn under ``seed`` into ``directory`` in ``layout``; return it."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = getattr(transformers, family.config_class)(**family.config)
    model = model_class(family)(config)
    perturb_vectors(model, seed)
    model.save_pretrained(directory)
    weights = directory / "model.safetensors"
    if layout == "memory":
        save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()}, str(weights),
                  metadata={"format": "pt"})
    elif layout == "hub":
        tensors = load_file(str(weights))
        save_file({_relabel(k, family.hub_prefixes): v.transpose(1, 2).contiguous()
                   if k.endswith(family.hub_transposed) and family.hub_transposed else v
                   for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    return directory


def _relabel(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def inputs(family: Vlm, model: Any) -> dict[str, Any]:
    """A dummy image + text batch for ``model`` (a loaded ``family`` model): pixel values of the right shape
    and as many image tokens as the image yields."""
    import torch

    builders: Mapping[str, Callable[[Any], dict[str, Any]]] = {
        "llava": lambda m: _plain(m, 4, torch.rand(1, 3, 16, 16)),
        "gemma3": lambda m: _plain(m, 4, torch.rand(1, 3, 16, 16)),
        "mistral3": lambda m: {**_plain(m, 4, torch.rand(1, 3, 16, 16)), "image_sizes": torch.tensor([[16, 16]])},
        "qwen2_vl": _qwen,
        "qwen2_5_vl": _qwen,
        "idefics3": lambda m: {**_plain(m, 4, torch.rand(1, 1, 3, 16, 16)),
                               "pixel_attention_mask": torch.ones(1, 1, 16, 16, dtype=torch.bool)},
    }
    return builders[family.name](model)


def _plain(model: Any, image_tokens: int, pixels: Any) -> dict[str, Any]:
    import torch

    ids = torch.tensor([[1, *([_IMAGE_TOKEN] * image_tokens), 5, 9, 2]])
    return {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}


def _qwen(model: Any) -> dict[str, Any]:
    import torch

    # One 8x8 image: 2x2 patches of 4 pixels, merged 2x2 → 1 token; patches flattened as the processor does.
    grid = torch.tensor([[1, 2, 2]])
    pixels = torch.rand(4, 3 * 2 * 4 * 4)
    ids = torch.tensor([[1, 61, _IMAGE_TOKEN, 5, 9, 2]])
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == _IMAGE_TOKEN).long()}

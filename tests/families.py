"""Tiny real models of the families people merge, generated with transformers (a test-only dependency).

Each :class:`Family` is a model type with tiny sizes (hidden 32, 3 layers, vocab 128), saved with
``save_pretrained(safe_serialization=True)`` — sharded for some families — from weights drawn under a fixed seed,
so two seeds give two different models of one family and the same seed gives the same bytes. ``legacy_keys``
are removed from config.json after saving, to look like the hub configs written before transformers derived
``layer_types`` (Gemma 2/3, Qwen2 with a sliding window): those are the configs a frankenmerge must not get wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB = 128
LAYERS = 3
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_DECODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, **_TOKENS}


@dataclass(frozen=True)
class Family:
    """One model family: transformers ``model_type``, tiny config, and what its checkpoints look like."""

    name: str
    model_type: str
    config: Mapping[str, Any]
    layer_prefix: str  # where numbered layers live in the checkpoint
    count_key: str = "num_hidden_layers"
    tied: bool = False  # whether the saved checkpoint has no head of its own
    head: str | None = "lm_head.weight"  # the untied head's tensor name
    embedding: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    shard_size: str | None = None  # max_shard_size for save_pretrained (several shards plus an index)
    legacy_keys: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)  # written into config.json after saving


FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", _DECODER, "model.layers", shard_size="20KB"),
    Family("mistral", "mistral", {**_DECODER, "sliding_window": 32}, "model.layers"),
    Family("mixtral", "mixtral", {**_DECODER, "num_local_experts": 3, "num_experts_per_tok": 2}, "model.layers",
           shard_size="30KB"),
    # Qwen2.5-style small model: tied, and a sliding window above max_window_layers, with layer_types left for
    # transformers to derive (as in configs saved before it wrote the list).
    Family("qwen2", "qwen2", {**_DECODER, "tie_word_embeddings": True, "use_sliding_window": True,
                               "sliding_window": 16, "max_window_layers": 2}, "model.layers", tied=True,
           legacy_keys=("layer_types",)),
    Family("qwen3", "qwen3", {**_DECODER, "head_dim": 8, "tie_word_embeddings": True}, "model.layers", tied=True,
           shard_size="20KB"),
    # Layer 1 is dense (mlp_only_layers): its tensors differ from the MoE layers'.
    Family("qwen2_moe", "qwen2_moe", {**_DECODER, "num_experts": 3, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
                                      "mlp_only_layers": [1]}, "model.layers"),
    # decoder_sparse_step 2: layers 0 and 2 are dense, layer 1 has experts.
    Family("qwen3_moe", "qwen3_moe", {**_DECODER, "head_dim": 8, "num_experts": 3, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 16, "decoder_sparse_step": 2}, "model.layers"),
    Family("gemma", "gemma", {**_DECODER, "head_dim": 8}, "model.layers", tied=True),
    Family("gemma2", "gemma2", {**_DECODER, "head_dim": 8, "sliding_window": 16}, "model.layers", tied=True,
           legacy_keys=("layer_types",), shard_size="20KB"),
    # Gemma 3 text model (Gemma3ForCausalLM) with the legacy sliding_window_pattern instead of layer_types.
    Family("gemma3", "gemma3_text", {**_DECODER, "head_dim": 8, "sliding_window": 16}, "model.layers", tied=True,
           legacy_keys=("layer_types",), extra={"sliding_window_pattern": 2}),
    Family("phi3", "phi3", _DECODER, "model.layers"),
    Family("gpt2", "gpt2", {"vocab_size": VOCAB, "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "n_positions": 64,
                            **_TOKENS}, "transformer.h", count_key="n_layer", tied=True,
           embedding="transformer.wte.weight", final_norm="transformer.ln_f.weight", shard_size="20KB"),
    Family("gpt_neox", "gpt_neox", {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
                                    "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                    "max_position_embeddings": 64, **_TOKENS}, "gpt_neox.layers",
           head="embed_out.weight", embedding="gpt_neox.embed_in.weight",
           final_norm="gpt_neox.final_layer_norm.weight"),
    Family("falcon", "falcon", {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": LAYERS,
                                "num_attention_heads": 4, **_TOKENS}, "transformer.h", tied=True,
           embedding="transformer.word_embeddings.weight", final_norm="transformer.ln_f.weight"),
    # Families no table in resumerge names: the layout comes from tensor names alone (GPT-J's head has a bias;
    # BLOOM has a layer norm right after its embedding).
    Family("gptj", "gptj", {"vocab_size": VOCAB, "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "n_positions": 64,
                            "rotary_dim": 4, **_TOKENS}, "transformer.h", count_key="n_layer",
           embedding="transformer.wte.weight", final_norm="transformer.ln_f.weight"),
    Family("bloom", "bloom", {"vocab_size": VOCAB, "hidden_size": 32, "n_layer": LAYERS, "n_head": 4, **_TOKENS},
           "transformer.h", count_key="n_layer", tied=True, embedding="transformer.word_embeddings.weight",
           final_norm="transformer.ln_f.weight"),
)


def make_family_model(directory: Path, family: Family, seed: int) -> Path:
    """Save a randomly initialised ``family`` model (weights drawn under ``seed``) into ``directory``.

    Norm weights are perturbed too (transformers initialises them to constants), so every tensor of two seeds
    differs and every layer of one model differs from its neighbours.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family.model_type, **family.config)
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if family.shard_size is not None:
        kwargs["max_shard_size"] = family.shard_size
    model.save_pretrained(directory, **kwargs)
    path = directory / "config.json"
    doc = json.loads(path.read_text())
    for key in family.legacy_keys:
        doc.pop(key, None)
    doc.update(family.extra)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return directory

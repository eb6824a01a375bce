"""The output config.json of each MoE kind: the base model's config with the kind's
:class:`~resumerge.runs.moe.outkinds.ConfigPatch`, mergekit-moe 0.1.5's changes (as transformers 5 reads it back; the
bytes are resumerge's own sorted rendering)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from resumerge.runs.moe.outkinds import OutputKind

# The defaults transformers gives each input model type for what its config.json may leave out, where the MoE
# output's class defaults otherwise (Mixtral's rope_theta is 1e6, its rms_norm_eps 1e-5, ...): mergekit-moe builds
# the output from the base's full config object, so these are what its output holds.
_COMMON_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "intermediate_size": 11008, "hidden_size": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000, "hidden_act": "silu",
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None})
_SOURCE_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "llama": MappingProxyType({**_COMMON_DEFAULTS, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}),
    "mistral": MappingProxyType({**_COMMON_DEFAULTS, "max_position_embeddings": 131072, "intermediate_size": 14336,
                                 "num_key_value_heads": 8}),
    "qwen2": MappingProxyType({**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "intermediate_size": 22016,
                               "vocab_size": 151936, "bos_token_id": None, "eos_token_id": None,
                               "max_window_layers": 28}),
    "qwen3": MappingProxyType({**_COMMON_DEFAULTS, "max_position_embeddings": 32768, "intermediate_size": 22016,
                               "vocab_size": 151936, "bos_token_id": None, "eos_token_id": None,
                               "max_window_layers": 28, "attention_bias": False}),
})
_ROPE_KEYS = ("rope_theta", "rope_parameters", "rope_scaling")


def _with_defaults(base: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with its model type's defaults written out (see :data:`_SOURCE_DEFAULTS`)."""
    out: dict[str, Any] = copy.deepcopy(dict(base))
    for key, value in _SOURCE_DEFAULTS.get(str(out.get("model_type")), {}).items():
        out.setdefault(key, value)
    out.setdefault("num_key_value_heads", out["num_attention_heads"])
    if out.get("model_type") != "qwen2":
        out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
    if not any(k in out for k in _ROPE_KEYS):
        out["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    return out


def moe_config(kind: OutputKind, base: Mapping[str, Any], *, experts: int, shared: int, per_token: int,
               dtype: str | None) -> dict[str, Any]:
    """config.json of a ``kind`` output with ``experts`` routed experts (and ``shared`` shared ones) built on
    the ``base`` config, ``dtype`` the output dtype's name (None: the base's, left as it is)."""
    out = _with_defaults(base)
    patch = kind.config
    intermediate = out.get("intermediate_size")
    out.update(copy.deepcopy(dict(patch.fixed)), architectures=[patch.architecture], model_type=patch.model_type,
               num_experts_per_tok=per_token)
    out[patch.experts_key] = experts
    if patch.shared_key is not None:
        out[patch.shared_key] = shared or None
    for key in patch.intermediate_keys:
        out[key] = intermediate
    for key, value in patch.defaults.items():
        out.setdefault(key, copy.deepcopy(value))
    if dtype is not None:
        out["dtype"] = dtype
        if patch.torch_dtype or "torch_dtype" in out:
            out["torch_dtype"] = dtype
    return out


def not_power_of_two(experts: int) -> str | None:
    """mergekit-moe's warning for an expert count llama.cpp cannot use, or None."""
    if experts & (experts - 1) == 0:
        return None
    return f"Your model has {experts} experts, which is not a power of two. The model will not be usable in llama.cpp."

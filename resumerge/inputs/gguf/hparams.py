"""The output config.json's hyperparameters a GGUF output's ``{arch}.*`` keys are written from (``gguf.md`` §4),
checked at plan time: a key the family needs that is absent, or a value of the wrong type, is refused in one line
(exit 2) before anything is written, instead of failing in the key writer; an absent key transformers itself
defaults (how many experts route a token, a Qwen-MoE's unused dense width) takes transformers' default, as
transformers would load the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from resumerge.errors import ModelInputError

# transformers' defaults (its configuration classes, 5.x) for the keys a config.json may leave out that the key
# writer needs; tests/test_gguf_keys.py checks them against the installed transformers.
CHOSEN_DEFAULT: Mapping[str, int] = {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8}
# Qwen-MoE's intermediate_size sizes only its dense layers, which a GGUF resumerge writes has none of
# (names.check_routing): the feed_forward_length key is written from transformers' default where it is absent.
DENSE_WIDTH_DEFAULT: Mapping[str, int] = {"qwen2_moe": 5632, "qwen3_moe": 6144}
# The mixtures of experts resumerge writes as GGUF, by model_type: the key holding their routed expert count.
_COUNT_KEY = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}
# Keys every written family needs, and transformers' defaults for which describe its reference model (Llama-7B's
# 4096 wide, 32 layers...), not the tensors: a GGUF written with them would not load, nor would transformers load
# the weights with them.
_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# Keys read when present (else the writer's fallback): of every family, of Gemma's, of Qwen-MoE's.
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_FLOATS = ("rms_norm_eps", "rope_theta")
_GEMMA = ("gemma2", "gemma3", "gemma3_text")
_GEMMA_INTS, _GEMMA_FLOATS = ("sliding_window",), ("attn_logit_softcapping", "final_logit_softcapping",
                                                   "rope_local_base_freq")
_QWEN_MOE = ("qwen2_moe", "qwen3_moe")
_QWEN_MOE_INTS = ("moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step")
_HINT = "fix the key in the config.json the output's is built from (the base model's), or write it as safetensors"


def gguf_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (the output's config.json) with the keys a GGUF output's key writer reads checked, and an absent
    ``num_experts_per_tok`` set to transformers' default for the family. Raises :class:`ModelInputError` (exit 2)
    for a key the family needs that is absent or null, a value of the wrong type, or a default that cannot route
    (more experts chosen than the model has)."""
    model_type = str(config.get("model_type"))
    if config.get("intermediate_size") is None and model_type in DENSE_WIDTH_DEFAULT:
        config = {**config, "intermediate_size": DENSE_WIDTH_DEFAULT[model_type]}
    done = dict(config)
    for key in _SHAPE:
        if config.get(key) is None:
            raise ModelInputError(f"the output's config.json has no {key}, which a GGUF output of a {model_type} "
                                  "needs (transformers' default is another model's, not these tensors')",
                                  hint=f"set {key} in the config.json the output's is built from (the base model's)")
        _count(config, key)
    gemma, qwen_moe = model_type in _GEMMA, model_type in _QWEN_MOE
    for key in (*_OPTIONAL_INTS, *(_GEMMA_INTS if gemma else ()), *(_QWEN_MOE_INTS if qwen_moe else ())):
        if config.get(key) is not None:
            _count(config, key)
    for key in (*_OPTIONAL_FLOATS, *(_GEMMA_FLOATS if gemma else ())):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ModelInputError(f"the output's config.json says {key}: {json.dumps(value)}, where a number "
                                  "belongs", hint=_HINT)
    normalises = config.get("norm_topk_prob") if qwen_moe else None
    if normalises is not None and not isinstance(normalises, bool):
        raise ModelInputError(f"the output's config.json says norm_topk_prob: {json.dumps(normalises)}, where true "
                              "or false belongs", hint=_HINT)
    count_key = _COUNT_KEY.get(model_type)
    count = config.get("num_experts") or config.get("num_local_experts")
    if count_key is not None and not count:
        raise ModelInputError(f"the output's config.json has no {count_key}, which a GGUF output of a {model_type} "
                              "needs (transformers' default is another model's expert count, not these tensors')",
                              hint=f"set {count_key} in the config.json the output's is built from (the base "
                                   "model's)")
    if not count:
        return done
    count = _count(config, "num_experts" if config.get("num_experts") else "num_local_experts")
    chosen = config.get("num_experts_per_tok")
    if chosen is None:
        chosen = CHOSEN_DEFAULT.get(model_type)
        if chosen is None or chosen > count:
            said = f"transformers' default for a {model_type}, {chosen}, exceeds its {count} experts" if chosen else (
                f"no default for a {model_type}")
            raise ModelInputError(f"the output's config.json has no num_experts_per_tok (how many experts route each "
                                  f"token), and {said}", hint="set num_experts_per_tok in the config.json the "
                                                              "output's is built from (the base model's)")
        done["num_experts_per_tok"] = chosen
    elif _count(config, "num_experts_per_tok") > count:
        raise ModelInputError(f"the output's config.json says num_experts_per_tok: {chosen}, more than its {count} "
                              "experts", hint=_HINT)
    return done


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(config: Mapping[str, Any], key: str) -> int:
    """``config[key]``, refused unless a positive integer (a GGUF u32 key, or a count llama.cpp sizes by)."""
    value = config[key]
    if not _is_int(value) or value < 1:
        raise ModelInputError(f"the output's config.json says {key}: {json.dumps(value)}, where a positive whole "
                              "number belongs", hint=_HINT)
    return int(value)

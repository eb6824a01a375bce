"""The output config.json's hyperparameters a GGUF output's ``{arch}.*`` keys are written from (``gguf.md`` §4),
checked at plan time: a key the family needs that is absent, or a value of the wrong type, is refused in one line
(exit 2) before anything is written, instead of failing in the key writer; an absent key transformers itself
defaults (how many experts route a token, a Qwen-MoE's unused dense width) takes transformers' default, as
transformers would load the model. So does every other key the writer reads that config.json leaves out (head_dim,
num_key_value_heads, rms_norm_eps, rope_theta, max_position_embeddings, Gemma's window and softcaps), read from
transformers' own configuration class for the family: the GGUF then computes what the safetensors merge computes in
transformers (and in resumerge's forward, whose native config applies the same defaults). An attention width so
completed that the tensors contradict is refused: transformers would not load those weights either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from resumerge.config.params import is_whole
from resumerge.errors import InputError, ModelInputError
from resumerge.inputs.gguf.names import expert_count

# transformers' defaults (its configuration classes, 5.x) for the keys a config.json may leave out that the key
# writer needs; tests/test_gguf_keys.py checks them against the installed transformers.
CHOSEN_DEFAULT: Mapping[str, int] = MappingProxyType({"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8})
# Qwen-MoE's intermediate_size sizes only its dense layers, which a GGUF resumerge writes has none of
# (names.check_routing): the feed_forward_length key is written from transformers' default where it is absent.
DENSE_WIDTH_DEFAULT: Mapping[str, int] = MappingProxyType({"qwen2_moe": 5632, "qwen3_moe": 6144})
# The mixtures of experts resumerge writes as GGUF, by model_type: the key holding their routed expert count.
_COUNT_KEY = MappingProxyType({"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"})
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
# transformers' attribute holding each key the writer reads where config.json may leave it out; rope_theta is read
# from rope_parameters (transformers 5 folds it in there).
_COMPLETED = (*_OPTIONAL_INTS, "rms_norm_eps")
_GEMMA_COMPLETED = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")
# transformers' values (its configuration classes, 5.x) of the keys a plain config.json of these families most often
# leaves out, the same for every config of the family: head_dim is the width over the heads (None here), rope_theta
# its RoPE base. A config missing only these is completed without importing transformers (1.8 of a llama GGUF
# plan's 2.1 s); tests/test_gguf_defaults.py checks them against the installed transformers. A config with RoPE
# parameters is transformers' to read (its rope_theta may come from them, or be unset).
KNOWN_DEFAULTS: Mapping[str, Mapping[str, float | None]] = MappingProxyType({
    "llama": {"head_dim": None, "rope_theta": 10000.0}, "mistral": {"head_dim": None, "rope_theta": 10000.0}})
_HINT = "fix the key in the config.json the output's is built from (the base model's), or write it as safetensors"


def gguf_hparams(config: Mapping[str, Any], attention: tuple[int, int] | None = None) -> dict[str, Any]:
    """``config`` (the output's config.json) with the keys a GGUF output's key writer reads checked, and each one
    it leaves out (or null) set to what transformers' configuration class for the family makes of it
    (:func:`transformers_defaults`); ``attention`` is the tensors' query and key widths (layer 0's q_proj and
    k_proj rows), when known. Raises :class:`ModelInputError` (exit 2) for a key the family needs that is absent or
    null, a value of the wrong type, a default that cannot route (more experts chosen than the model has), or an
    attention width completed from transformers that the tensors contradict."""
    config = dict(config)  # completed in place: what the key writer reads
    model_type = str(config.get("model_type"))
    if config.get("intermediate_size") is None and model_type in DENSE_WIDTH_DEFAULT:
        config["intermediate_size"] = DENSE_WIDTH_DEFAULT[model_type]
    for key in _SHAPE:
        if config.get(key) is None:
            raise ModelInputError(f"the output's config.json has no {key}, which a GGUF output of a {model_type} "
                                  "needs (transformers' default is another model's, not these tensors')",
                                  hint=f"set {key} in the config.json the output's is built from (the base model's)")
        _count(config, key)
    gemma, qwen_moe = model_type in _GEMMA, model_type in _QWEN_MOE
    wanted = (*_COMPLETED, *(_GEMMA_COMPLETED if gemma else ()), "rope_theta",
              *(("rope_local_base_freq",) if model_type in ("gemma3", "gemma3_text") else ()))
    missing = [key for key in wanted if config.get(key) is None
               and not (key == "rope_theta" and _nested_theta(config) is not None)]
    if missing:
        completed = known_defaults(config, missing)
        if completed is None:
            completed = {k: v for k, v in transformers_defaults(config, missing).items() if v is not None}
        config.update(completed)
        if attention is not None:
            _check_widths(config, attention, completed)
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
    count = expert_count(config)
    if count_key is not None and not count:
        raise ModelInputError(f"the output's config.json has no {count_key}, which a GGUF output of a {model_type} "
                              "needs (transformers' default is another model's expert count, not these tensors')",
                              hint=f"set {count_key} in the config.json the output's is built from (the base "
                                   "model's)")
    if not count:
        return config
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
        config["num_experts_per_tok"] = chosen
    elif _count(config, "num_experts_per_tok") > count:
        raise ModelInputError(f"the output's config.json says num_experts_per_tok: {chosen}, more than its {count} "
                              "experts", hint=_HINT)
    return config


def known_defaults(config: Mapping[str, Any], keys: list[str]) -> dict[str, Any] | None:
    """What :func:`transformers_defaults` answers for ``keys``, where :data:`KNOWN_DEFAULTS` holds every one of them
    for the config's ``model_type``, the config leaves them out (a null is transformers' to read: its rope_theta
    stays unset) and has no RoPE parameters; None where transformers must be asked."""
    known = KNOWN_DEFAULTS.get(str(config.get("model_type")))
    if known is None or any(k not in known or k in config for k in keys) or config.get("rope_scaling") is not None \
            or config.get("rope_parameters") is not None:
        return None
    heads = config["num_attention_heads"]
    return {k: known[k] if k != "head_dim" else config["hidden_size"] // heads for k in keys}


def transformers_defaults(config: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
    """What transformers makes of each of ``keys`` when it loads ``config``: its configuration class for the
    ``model_type`` built from ``config``, so that a default depending on another key (Llama's
    ``num_key_value_heads``, its attention heads; its ``head_dim``, the width over the heads) is as transformers
    computes it. None for a key transformers leaves unset (a Qwen2's ``head_dim``: the model divides the width).
    Raises :class:`InputError` (exit 2) where transformers is not installed, and :class:`ModelInputError`
    where it refuses ``config``."""
    try:
        from transformers import CONFIG_MAPPING
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise InputError(f"the output's config.json has no {', '.join(keys)}, whose values for a GGUF are "
                                "transformers' defaults, and transformers is not installed",
                                hint=f"install resumerge[check], or set {keys[0]} in the config.json the output's "
                                     "is built from (the base model's)") from None
    model_type = str(config.get("model_type"))
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its warnings about the config's other keys are not this check's
    try:
        built = CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as e:  # transformers' refusal, whatever its type, is the user's to fix
        raise ModelInputError(f"transformers refuses the output's config.json: {str(e).splitlines()[0]}",
                              hint=_HINT) from None
    finally:
        hf_logging.set_verbosity(before)
    rope = getattr(built, "rope_parameters", None) or {}
    full, local = (rope.get("full_attention"), rope.get("sliding_attention")) if isinstance(rope, dict) else (None,
                                                                                                            None)
    found: dict[str, Any] = {}
    for key in keys:
        if key == "rope_theta":
            theta = getattr(built, "rope_theta", None)
            if theta is None and isinstance(rope, dict):
                theta = rope.get("rope_theta", full.get("rope_theta") if isinstance(full, dict) else None)
            found[key] = theta
        elif key == "rope_local_base_freq":
            found[key] = getattr(built, key, None) or (local.get("rope_theta") if isinstance(local, dict) else None)
        else:
            found[key] = getattr(built, key, None)
    return found


def _nested_theta(config: Mapping[str, Any]) -> Any:
    rope = config.get("rope_parameters")
    return rope.get("rope_theta") if isinstance(rope, Mapping) else None


def _check_widths(config: Mapping[str, Any], attention: tuple[int, int], completed: Mapping[str, Any]) -> None:
    """Refuse a ``head_dim`` or ``num_key_value_heads`` taken from transformers' defaults that the tensors'
    query and key widths contradict."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv = config.get("num_key_value_heads") or heads
    for key, value, width, rows in (("head_dim", head_dim, "query", heads * head_dim),
                                    ("num_key_value_heads", kv, "key", kv * head_dim)):
        if key in completed and rows != attention[width == "key"]:
            raise ModelInputError(
                f"the output's config.json has no {key}, for which transformers would use {value}, and the "
                f"tensors' {width} width is {attention[width == 'key']}, not {rows}: neither llama.cpp nor "
                "transformers would load these weights with it",
                hint=f"set {key} in the config.json the output's is built from (the base model's) to the model's own")


def _count(config: Mapping[str, Any], key: str) -> int:
    """``config[key]``, refused unless a positive integer (a GGUF u32 key, or a count llama.cpp sizes by)."""
    value = config[key]
    if not is_whole(value) or value < 1:
        raise ModelInputError(f"the output's config.json says {key}: {json.dumps(value)}, where a positive whole "
                              "number belongs", hint=_HINT)
    return int(value)

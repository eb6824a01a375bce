"""A model's config.json read as transformers 5 reads it for the families the native modules build, or None.

Each family's defaults are the ones its transformers config class applies to a key config.json leaves out (the
tests build each family from a config.json missing every optional key and compare with transformers' modules).
Whatever would make the forward differ from the few operations :mod:`.modules` implements — another family, a
RoPE scaling other than none, ``linear`` or ``llama3``, a partial rotary factor, an activation other than SiLU, a
sliding-window layer without a window, a key of an unexpected type — returns None: the model is built by
transformers, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# What each family's transformers config class fills in for a key config.json leaves out (transformers 5).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28},
}
_THETA = 10000.0  # transformers' default rope_theta
_ROPE_TYPES = ("default", "linear", "llama3")
_SILU = ("silu", "swish")
_FULL, _SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Rope:
    """The rotary embedding's parameters: ``kind`` (``default``, ``linear``, ``llama3``), the base ``theta``, and
    the scaling's ``factor``, ``low_freq_factor``, ``high_freq_factor`` and ``original_max`` where it has them."""

    kind: str
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max: int = 0


@dataclass(frozen=True)
class NativeConfig:
    """What the native modules are built from. Attribute names are transformers' (the forward engine and the
    check read ``num_hidden_layers``, ``hidden_size``, ``intermediate_size``, ``tie_word_embeddings``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple[int | None, ...]  # each layer's sliding window, None for full attention
    rope: Rope
    pad_token_id: int | None

    def get_text_config(self) -> NativeConfig:
        """Itself: a text model (transformers' configs answer with their language model's config)."""
        return self


class _Unknown(Exception):
    """The config holds something the native modules do not implement (caught: transformers builds it)."""


def read_config(doc: Mapping[str, Any]) -> NativeConfig | None:
    """``doc`` (a config.json) as the native modules' config, or None where transformers must build it."""
    family = doc.get("model_type")
    if not isinstance(family, str) or family not in _DEFAULTS:
        return None
    try:
        return _read(family, {**_DEFAULTS[family], **{k: v for k, v in doc.items() if v is not None
                                                       or k in ("sliding_window", "num_key_value_heads",
                                                                "head_dim", "pad_token_id")}})
    except _Unknown:
        return None


def _read(family: str, doc: Mapping[str, Any]) -> NativeConfig:
    if str(doc.get("hidden_act", "silu")) not in _SILU:
        raise _Unknown
    if "partial_rotary_factor" in doc or doc.get("pretraining_tp", 1) not in (1, None):
        raise _Unknown
    hidden, heads = _int(doc, "hidden_size"), _int(doc, "num_attention_heads")
    layers = _int(doc, "num_hidden_layers")
    head_dim = doc.get("head_dim") or hidden // heads
    kv = doc.get("num_key_value_heads") or heads
    if not isinstance(head_dim, int) or not isinstance(kv, int) or heads % kv:
        raise _Unknown
    bias = bool(doc.get("attention_bias", False))
    qkv_bias, o_bias = {"llama": (bias, bias), "mistral": (False, False), "qwen2": (True, False),
                        "qwen3": (bias, bias)}[family]
    return NativeConfig(
        model_type=family, vocab_size=_int(doc, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(doc, "intermediate_size"), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=_float(doc, "rms_norm_eps"),
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=family == "llama" and bool(doc.get("mlp_bias", False)), qk_norm=family == "qwen3",
        windows=_windows(family, doc, layers), rope=_rope(doc),
        pad_token_id=doc.get("pad_token_id") if isinstance(doc.get("pad_token_id"), int) else None)


def _windows(family: str, doc: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: Mistral's on every layer (none where ``sliding_window`` is null); Qwen2's and
    Qwen3's only with ``use_sliding_window``, on the layers ``layer_types`` (or ``max_window_layers``) names."""
    if family == "llama":
        return (None,) * layers
    if family == "mistral":
        if "layer_types" in doc:  # transformers warns and builds Mistral's classes, which ignore it: not ours
            raise _Unknown
        window = doc.get("sliding_window")
        return (_window(window),) * layers
    window = _window(doc.get("sliding_window")) if doc.get("use_sliding_window") else None
    types = doc.get("layer_types")
    if types is None:
        types = [_SLIDING if window is not None and i >= _int(doc, "max_window_layers") else _FULL
                 for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (_FULL, _SLIDING) for t in types):
        raise _Unknown
    if _SLIDING in types and window is None:
        raise _Unknown
    return tuple(window if t == _SLIDING else None for t in types)


def _window(value: object) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _Unknown
    return value


def _rope(doc: Mapping[str, Any]) -> Rope:
    """The rotary parameters from ``rope_scaling`` and ``rope_theta`` (the older keys, first where both are given)
    or ``rope_parameters`` (transformers 5), as transformers' config standardises them."""
    params = doc.get("rope_scaling") or doc.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise _Unknown
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", doc.get("rope_theta", _THETA))
    if kind not in _ROPE_TYPES or "partial_rotary_factor" in params or not isinstance(theta, (int, float)):
        raise _Unknown
    if kind == "default":
        return Rope("default", float(theta))
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise _Unknown
    if kind == "linear":
        return Rope("linear", float(theta), float(factor))
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    # a top-level original_max_position_embeddings overrides the scaling's own, as transformers standardises it
    original = doc.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", doc.get("max_position_embeddings")))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high, original)):
        raise _Unknown
    assert isinstance(low, (int, float)) and isinstance(high, (int, float)) and isinstance(original, (int, float))
    if high == low:
        raise _Unknown
    return Rope("llama3", float(theta), float(factor), float(low), float(high), int(original))


def _int(doc: Mapping[str, Any], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _Unknown
    return value


def _float(doc: Mapping[str, Any], key: str) -> float:
    value = doc.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _Unknown
    return float(value)

"""A model's config.json read as transformers 5 reads it for the families the native modules build, or None.

Each family's defaults are the ones its transformers config class applies to a key config.json leaves out (the
tests build each family from a config.json missing every optional key and compare with transformers' modules).
Whatever would make the forward differ from the few operations :mod:`.modules` implements — another family, a
RoPE scaling other than none, ``linear`` or ``llama3``, a partial rotary factor, an activation other than the
family's (SiLU; Gemma's tanh GELU), a sliding-window layer without a window, bidirectional attention, a key of an
unexpected type — returns None: the model is built by transformers, as before. Phi-3 (and Phi-4, model_type
``phi3``) is Mistral's layer with fused projections (``qkv_proj``, ``gate_up_proj``), plain RoPE only (its longrope
is transformers').
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

_GELU_TANH = "gelu_pytorch_tanh"

# What each family's transformers config class fills in for a key config.json leaves out (transformers 5).
_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
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
    # Phi-3 and Phi-4 (model_type phi3): fused qkv_proj and gate_up_proj
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": None, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "pad_token_id": 32000,
             "sliding_window": None},
})
# Gemma's families (gemma3_text: Gemma3ForCausalLM; the multimodal gemma3 is transformers'), read by _read_gemma.
_GEMMA = MappingProxyType({
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192, "pad_token_id": 0, "tie_word_embeddings": True, "attention_bias": False,
    "hidden_activation": _GELU_TANH, "query_pre_attn_scalar": 256, "sliding_window": 4096,
})
_GEMMA_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "gemma": {**_GEMMA, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": _GELU_TANH},
    "gemma2": {**_GEMMA, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "final_logit_softcapping": None},
})
# keys whose null in config.json is a value, not a key left out
_NULLABLE = ("sliding_window", "num_key_value_heads", "head_dim", "pad_token_id", "final_logit_softcapping",
             "attn_logit_softcapping")
_THETA = 10000.0  # transformers' default rope_theta
_GEMMA3_THETAS = (1_000_000.0, 10_000.0)  # Gemma 3's defaults: global (full attention) and local (sliding)
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
    # Gemma's ways, each off for the other families
    hidden_act: str = "silu"  # the gate's activation: silu, or gelu_pytorch_tanh (GELU's tanh approximation)
    offset_norms: bool = False  # RMS norms scale by 1 + weight, in float32, cast back after
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size), cast to the weights' dtype
    sandwich_norms: bool = False  # norms after attention and the MLP too (and one before the MLP)
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power (else head_dim's)
    eager_attention: bool = False  # transformers' eager attention (an additive mask, softmax in float32)
    attn_logit_softcapping: float | None = None  # scores capped by cap * tanh(scores / cap) (eager only)
    final_logit_softcapping: float | None = None  # logits capped likewise
    local_rope: Rope | None = None  # the sliding-window layers' rotary embedding, where it differs
    fused: bool = False  # Phi-3: one qkv_proj (queries, keys, values) and one gate_up_proj (gate, up)

    def get_text_config(self) -> NativeConfig:
        """Itself: a text model (transformers' configs answer with their language model's config)."""
        return self


class _Unknown(Exception):
    """The config holds something the native modules do not implement (caught: transformers builds it)."""


def read_config(doc: Mapping[str, Any]) -> NativeConfig | None:
    """``doc`` (a config.json) as the native modules' config, or None where transformers must build it."""
    family = doc.get("model_type")
    if not isinstance(family, str) or (family not in _DEFAULTS and family not in _GEMMA_DEFAULTS):
        return None
    given = {k: v for k, v in doc.items() if v is not None or k in _NULLABLE}
    try:
        if family in _GEMMA_DEFAULTS:
            return _read_gemma(family, {**_GEMMA_DEFAULTS[family], **given})
        return _read(family, {**_DEFAULTS[family], **given})
    except _Unknown:
        return None


def _read(family: str, doc: Mapping[str, Any]) -> NativeConfig:
    if str(doc.get("hidden_act", "silu")) not in _SILU:
        raise _Unknown
    if not _whole_rotary(doc) or doc.get("pretraining_tp", 1) not in (1, None):
        raise _Unknown
    hidden, heads = _int(doc, "hidden_size"), _int(doc, "num_attention_heads")
    layers = _int(doc, "num_hidden_layers")
    head_dim = doc.get("head_dim") or hidden // heads
    kv = doc.get("num_key_value_heads") or heads
    if not isinstance(head_dim, int) or not isinstance(kv, int) or heads % kv:
        raise _Unknown
    bias = bool(doc.get("attention_bias", False))
    qkv_bias, o_bias = {"llama": (bias, bias), "mistral": (False, False), "qwen2": (True, False),
                        "qwen3": (bias, bias), "phi3": (False, False)}[family]
    rope = _rope(doc)
    if family == "phi3" and rope.kind != "default":  # its config takes only longrope besides (not ours)
        raise _Unknown
    return NativeConfig(
        model_type=family, vocab_size=_int(doc, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(doc, "intermediate_size"), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=_float(doc, "rms_norm_eps"),
        tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=family == "llama" and bool(doc.get("mlp_bias", False)), qk_norm=family == "qwen3",
        windows=_windows(family, doc, layers), rope=rope,
        pad_token_id=doc.get("pad_token_id") if isinstance(doc.get("pad_token_id"), int) else None,
        fused=family == "phi3")


def _whole_rotary(doc: Mapping[str, Any]) -> bool:
    """Whether every dimension of a head is rotated: no ``partial_rotary_factor``, or 1 (Phi-3's config writes it
    into its RoPE parameters; the frequencies are the same)."""
    return bool(doc.get("partial_rotary_factor", 1.0) == 1.0)


def _windows(family: str, doc: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window: Mistral's and Phi-3's on every layer (none where ``sliding_window`` is null,
    Phi-3's default); Qwen2's and
    Qwen3's only with ``use_sliding_window``, on the layers ``layer_types`` (or ``max_window_layers``) names."""
    if family == "llama":
        return (None,) * layers
    if family in ("mistral", "phi3"):
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
    if not isinstance(params, Mapping) or _FULL in params or _SLIDING in params:  # one per layer type: not ours
        raise _Unknown
    # a top-level original_max_position_embeddings overrides the scaling's own, as transformers standardises it
    original = doc.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", doc.get("max_position_embeddings")))
    return _rope_of(params, params.get("rope_theta", doc.get("rope_theta", _THETA)), original)


def _rope_of(params: Mapping[str, Any], theta: object, original: object) -> Rope:
    """One rotary embedding's parameters from its standardised dict, its base ``theta`` and the original maximum
    length ``original`` Llama 3's scaling falls back to."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES or not _whole_rotary(params) or not isinstance(theta, (int, float)):
        raise _Unknown
    if kind == "default":
        return Rope("default", float(theta))
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise _Unknown
    if kind == "linear":
        return Rope("linear", float(theta), float(factor))
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high, original)):
        raise _Unknown
    assert isinstance(low, (int, float)) and isinstance(high, (int, float)) and isinstance(original, (int, float))
    if high == low:
        raise _Unknown
    return Rope("llama3", float(theta), float(factor), float(low), float(high), int(original))


def _read_gemma(family: str, doc: Mapping[str, Any]) -> NativeConfig:
    """Gemma (1), Gemma 2 and Gemma 3's text model: the RMS norms' 1 + weight, the embeddings' scale, the tanh
    GELU; from Gemma 2 on, the norms around attention and the MLP, ``query_pre_attn_scalar``, sliding and full
    layers alternating and the logits' soft-capping; Gemma 2's eager attention (transformers builds Gemma 2 with
    it: its sdpa cannot soft-cap scores), Gemma 3's q/k norms and its local and global rotary embeddings."""
    act = doc.get("hidden_act") if family == "gemma" else doc.get("hidden_activation")
    if act == "gelu" and family == "gemma":  # a legacy value transformers reads as the tanh approximation
        act = _GELU_TANH
    if act != _GELU_TANH or doc.get("use_bidirectional_attention") or "partial_rotary_factor" in doc:
        raise _Unknown
    hidden, heads = _int(doc, "hidden_size"), _int(doc, "num_attention_heads")
    layers, head_dim, kv = _int(doc, "num_hidden_layers"), _int(doc, "head_dim"), _int(doc, "num_key_value_heads")
    if heads % kv or (family != "gemma" and hidden % heads):  # transformers refuses the latter
        raise _Unknown
    bias = doc.get("attention_bias")
    if not isinstance(bias, bool):
        raise _Unknown
    later = family != "gemma"
    if later:
        types = _gemma_types(family, doc, layers)
        window = _window(doc.get("sliding_window"))
        if _SLIDING in types and window is None:
            raise _Unknown
        windows = tuple(window if t == _SLIDING else None for t in types)
    else:
        windows = (None,) * layers
    rope, local = _gemma3_ropes(doc) if family == "gemma3_text" else (_rope(doc), None)
    return NativeConfig(
        model_type=family, vocab_size=_int(doc, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(doc, "intermediate_size"), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=_float(doc, "rms_norm_eps"),
        tie_word_embeddings=bool(doc.get("tie_word_embeddings")), qkv_bias=bias, o_bias=bias, mlp_bias=False,
        qk_norm=family == "gemma3_text", windows=windows, rope=rope,
        pad_token_id=doc.get("pad_token_id") if isinstance(doc.get("pad_token_id"), int) else None,
        hidden_act=_GELU_TANH, offset_norms=True, embed_scale=True, sandwich_norms=later,
        query_pre_attn_scalar=_scalar(doc) if later else None,
        eager_attention=family == "gemma2",
        attn_logit_softcapping=_cap(doc, "attn_logit_softcapping") if family == "gemma2" else None,
        final_logit_softcapping=_cap(doc, "final_logit_softcapping") if later else None, local_rope=local)


def _gemma_types(family: str, doc: Mapping[str, Any], layers: int) -> list[str]:
    """Each layer's attention type: ``layer_types``, else every other layer sliding from the first (Gemma 2) or
    all but every ``sliding_window_pattern``-th (Gemma 3, the older key: 6 where it too is left out)."""
    types = doc.get("layer_types")
    if types is None:
        pattern = 2 if family == "gemma2" else doc.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise _Unknown
        types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in (_FULL, _SLIDING) for t in types):
        raise _Unknown
    return types


def _gemma3_ropes(doc: Mapping[str, Any]) -> tuple[Rope, Rope]:
    """Gemma 3's global (full attention) and local (sliding) rotary parameters: ``rope_parameters`` by layer type,
    or the older ``rope_scaling`` (the global one's scaling), ``rope_theta`` and ``rope_local_base_freq``."""
    given = doc.get("rope_parameters")
    if given is None:
        given = {_FULL: None, _SLIDING: None}
    scaling = doc.get("rope_scaling")
    if (not isinstance(given, Mapping) or any(k not in (_FULL, _SLIDING) for k in given)
            or (scaling is not None and (_FULL not in given or not isinstance(scaling, Mapping)))):
        raise _Unknown
    full, local = given.get(_FULL) or {}, given.get(_SLIDING) or {}
    if not isinstance(full, Mapping) or not isinstance(local, Mapping):
        raise _Unknown
    full = {**full, **(scaling or {})}
    original = doc.get("max_position_embeddings")
    return (_rope_of(full, full.get("rope_theta", doc.get("rope_theta", _GEMMA3_THETAS[0])), original),
            _rope_of(local, local.get("rope_theta", doc.get("rope_local_base_freq", _GEMMA3_THETAS[1])),
                     original))


def _scalar(doc: Mapping[str, Any]) -> float:
    value = _float(doc, "query_pre_attn_scalar")
    if value <= 0:
        raise _Unknown
    return value


def _cap(doc: Mapping[str, Any], key: str) -> float | None:
    return None if doc.get(key) is None else _float(doc, key)


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

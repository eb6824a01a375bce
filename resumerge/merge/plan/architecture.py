"""What resumerge knows about model families: where tensors sit, and what config.json says per layer.

The tensor layout is inferred from names, like mergekit's automatic architecture: a tensor name with a
``.<digits>.`` part belongs to a layer (prefix, index, suffix: the first numbered part counts); others are
pre-layer weights (embeddings) or post-layer weights (final norm, output head). Pre-layer weights come from the
first slice's models, post-layer weights from the last slice's, as mergekit does. This covers the families
people merge without a table per architecture: Llama, Mistral, Mixtral, Qwen2/2.5/3 and their MoE variants,
Gemma 1/2/3, Phi-3/4 (``model.layers.N``), GPT-2 and Falcon (``transformer.h.N``), GPT-NeoX
(``gpt_neox.layers.N``, untied head ``embed_out``).

The per-layer knowledge is what transformers 5 derives from config.json for each layer: its attention type
(:func:`layer_types_of`) and, for MoE models with some dense layers, whether it has experts
(:func:`dense_mlp_layers`). :mod:`resumerge.merge.plan.outconfig` uses both to describe the output's layers by the
source layer each one was made from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from resumerge.config.params import is_whole
from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.stacks import not_a_stack
from resumerge.merge.plan.modules import ModuleLayout, language_stack, layer_stacks, module_of
from resumerge.merge.plan.mtp import MtpLayout, split_indexed, split_top_level

if TYPE_CHECKING:
    from resumerge.config.merge_config import MergeConfig
    from resumerge.config.modelref import ModelRef
    from resumerge.inputs.model import ModelInput

_LAYER = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.(?P<suffix>.+)$")
# Names of loose tensors that precede the layers (token and position embeddings across families).
_PRE_MARKERS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings")
# Output heads: loose tensors under these top-level names follow the layers even when their name says "embed"
# (GPT-NeoX's untied head is ``embed_out``).
_HEAD_MODULES = ("lm_head", "embed_out")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# A model without its own head contributes the input embedding the head is tied to (tied embeddings).
TIED_NAMES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "lm_head.weight": (
        "model.embed_tokens.weight",  # Llama, Mistral, Qwen, Gemma, Phi-3
        "transformer.wte.weight",  # GPT-2
        "wte.weight",  # GPT-2 checkpoints saved without the ``transformer.`` prefix
        "transformer.word_embeddings.weight",  # Falcon
        "gpt_neox.embed_in.weight",
        "model.language_model.embed_tokens.weight",  # VLMs in transformers 5's in-memory names
        "model.text_model.embed_tokens.weight",  # Idefics3 / SmolVLM
    ),
    "language_model.lm_head.weight": ("language_model.model.embed_tokens.weight",),  # Llava, Gemma 3, Mistral 3
    "embed_out.weight": ("gpt_neox.embed_in.weight",),  # GPT-NeoX with tie_word_embeddings
})
# Every name a head may be tied to: what is_input_embedding asks of each of a plan's 46k names.
_TIED_ALTERNATIVES = frozenset(alt for alts in TIED_NAMES.values() for alt in alts)
# Per-layer lists in config.json that must follow the output's layers (transformers 5 validates their length):
# attention type, SmolLM3/Llama-4 NoPE flags, dense/sparse MLP type, per-layer head counts, GLM-5's indexer mode,
# Nemotron-H's block type. What slices re-index when transformers is not installed; with it, every list its config
# class makes per layer (resumerge.merge.plan.layerfacts).
PER_LAYER_KEYS = (
    "layer_types",
    "no_rope_layers",
    "mlp_layer_types",
    "num_attention_heads_per_layer",
    "num_key_value_heads_per_layer",
    "indexer_types",
    "layers_block_type",
)


@dataclass(frozen=True)
class Layout:
    """A model's tensors split into pre-layer names, per-layer suffixes, and post-layer names.

    ``layer_suffixes`` is the union over all layers; ``suffixes_by_layer[i]`` the suffixes layer ``i`` has
    (they differ in MoE models whose dense layers have no experts). In a multi-module model (a VLM) the layers
    are the language model's; ``other_modules`` holds the other stacks (vision tower, audio encoder, …). ``mtp`` is
    the model's multi-token-prediction module (:mod:`resumerge.merge.plan.mtp`), whose tensors are in none of the
    others.
    """

    layer_prefix: str | None
    num_layers: int
    pre: tuple[str, ...]
    layer_suffixes: tuple[str, ...]
    post: tuple[str, ...]
    suffixes_by_layer: tuple[tuple[str, ...], ...] = ()
    other_modules: tuple[ModuleLayout, ...] = ()
    mtp: MtpLayout | None = None

    def layer_name(self, index: int, suffix: str) -> str:
        """Full tensor name of ``suffix`` in layer ``index``."""
        return f"{self.layer_prefix}.{index}.{suffix}"

    def layer_start(self, index: int) -> str:
        """What every tensor name of layer ``index`` starts with: its :meth:`layer_name` is this plus its suffix."""
        return f"{self.layer_prefix}.{index}."

    def names(self) -> tuple[str, ...]:
        """Every tensor name of this layout but its other modules': pre-layer, each layer's, post-layer."""
        layers = (self.layer_name(i, s) for i in range(self.num_layers) for s in self.suffixes_of(i))
        return (*self.pre, *layers, *self.post)

    def suffixes_of(self, index: int) -> tuple[str, ...]:
        """The suffixes (sorted) of the tensors layer ``index`` holds."""
        if index < len(self.suffixes_by_layer):
            return self.suffixes_by_layer[index]
        return self.layer_suffixes


def split_layer_name(name: str) -> tuple[str, int, str] | None:
    """Return (prefix, layer index, suffix) for a layer tensor name, or None for a loose tensor."""
    match = _LAYER.match(name)
    if match is None:
        return None
    return match["prefix"], int(match["index"]), match["suffix"]


def is_head(name: str) -> bool:
    """Whether ``name`` is a loose output-head tensor (``lm_head.*``, GPT-NeoX ``embed_out.*``, and a VLM's
    ``language_model.lm_head.*`` as transformers 5 saves Llava, Gemma 3 and Mistral 3)."""
    parts = name.split(".", 2)
    if parts[0] == "language_model" and len(parts) > 1:
        return parts[1] in _HEAD_MODULES
    return parts[0] in _HEAD_MODULES


def is_input_embedding(name: str) -> bool:
    """Whether ``name`` is a model's token embedding (what a tied head shares)."""
    return name in _TIED_ALTERNATIVES or name.endswith("embed_tokens.weight")


def infer_layout(names: Iterable[str], config: Mapping[str, Any], *, where: str) -> Layout:
    """Infer the layout of a model from its tensor ``names`` and ``config`` (config.json).

    A multi-module model (a VLM) gets its language model's layers as the layout's layers and every other stack
    of layers in ``other_modules`` (see :mod:`resumerge.merge.plan.modules`); an MTP module (DeepSeek-V3's layers
    after the declared count, Qwen3-Next's ``mtp.*``) goes in ``mtp``. Raises :class:`ModelInputError` when the
    language model's layer count in config.json disagrees with the tensors, or no stack can be told to be the
    language model's.
    """
    numbered: dict[str, dict[int, list[str]]] = {}
    loose: list[str] = []
    for name in sorted(names):
        parts = split_layer_name(name)
        if parts is None:
            loose.append(name)
            continue
        group, index, suffix = parts
        numbered.setdefault(group, {}).setdefault(index, []).append(suffix)
    stacks, numbered_loose = layer_stacks(numbered)
    loose = sorted(loose + numbered_loose)
    mtp = split_top_level(stacks, loose)
    prefix = next(iter(stacks), None)
    if len(stacks) > 1:
        embedding = next((n for n in loose if is_input_embedding(n)), None)
        prefix = language_stack(stacks, embedding, where=where)
    declared = layer_count(config)
    if prefix is not None and mtp is None:
        mtp = split_indexed(prefix, stacks[prefix], declared)
    text = module_of(stacks[prefix], prefix) if prefix is not None else None
    found = text.num_layers if text is not None else 0
    if declared is not None and prefix is not None and declared != found:
        raise ModelInputError(
            f"config.json says {declared} layers but the weights hold layers 0..{found - 1}",
            path=where,
            hint="the model files are incomplete or config.json is wrong",
        )
    pre = tuple(n for n in loose if not is_head(n) and any(m in n for m in _PRE_MARKERS))
    post = tuple(n for n in loose if n not in pre)
    by_layer = text.suffixes_by_layer if text is not None else ()
    suffixes = tuple(sorted({s for layer in by_layer for s in layer}))
    others = tuple(module_of(stacks[p], p) for p in sorted(stacks) if p != prefix)
    return Layout(prefix, found, pre, suffixes, post, by_layer, others, mtp)


def layer_count(config: Mapping[str, Any]) -> int | None:
    """The number of layers config.json declares, or None when it has no known key. A config that counts each
    layer's attention and MLP blocks apart (Dory's ``layer_types``: an attention type, then ``mlp``, per layer)
    declares twice its layers."""
    for key in LAYER_COUNT_KEYS:
        value = config.get(key)
        if type(value) is int:
            return value // 2 if counts_blocks(config) else value
    text = config.get("text_config")
    if isinstance(text, dict):
        return layer_count(text)
    return None


def unsliceable(config: Mapping[str, Any]) -> str | None:
    """Why a stack of this family's layers other than its own is not a model of the family (None: it is)."""
    layers = layer_config(config)
    return not_a_stack(layers.get("model_type", config.get("model_type")), layers)


def counts_blocks(config: Mapping[str, Any]) -> bool:
    """Whether config.json counts a layer's attention and MLP blocks apart: ``layer_types`` naming an attention
    type, then ``mlp``, for each layer (Dory: transformers halves its counts as it reads them)."""
    kinds = config.get("layer_types")
    return (isinstance(kinds, list) and len(kinds) % 2 == 0 and len(kinds) > 0
            and all(k == "mlp" for k in kinds[1::2]) and "mlp" not in kinds[::2])


def layer_count_key(config: Mapping[str, Any]) -> str:
    """The config.json key that holds the layer count (``num_hidden_layers`` when none is present)."""
    for key in LAYER_COUNT_KEYS:
        if type(config.get(key)) is int:
            return key
    return "num_hidden_layers"


def layer_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of config.json that describes the decoder layers: ``text_config`` for wrapper configs
    (Gemma 3 multimodal) whose top level has no layer count, else the config itself."""
    text = config.get("text_config")
    if any(type(config.get(k)) is int for k in LAYER_COUNT_KEYS) or not isinstance(text, dict):
        return config
    return text


# ---- per-layer attention types -----------------------------------------------------------------------------
# How transformers 5 fills ``layer_types`` when config.json has none (configuration_<family>.py), per family.
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _qwen2_type(cfg: Mapping[str, Any], i: int) -> str:
    # Qwen2 / Qwen3: the bottom max_window_layers use full attention, the rest a sliding window when enabled.
    on = bool(cfg.get("use_sliding_window", False)) and cfg.get("sliding_window", 4096) is not None
    return _SLIDING if on and i >= int(cfg.get("max_window_layers", 28)) else _FULL


def _qwen2_moe_type(cfg: Mapping[str, Any], i: int) -> str:
    on = bool(cfg.get("use_sliding_window", False))
    return _SLIDING if on and (i + 1) % 2 and i < int(cfg.get("max_window_layers", 28)) else _FULL


def _gemma2_type(cfg: Mapping[str, Any], i: int) -> str:
    return _SLIDING if (i + 1) % 2 else _FULL


def _qwen3_next_type(cfg: Mapping[str, Any], i: int) -> str:
    # Every full_attention_interval-th layer is full attention, the others linear (gated DeltaNet).
    return "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear_attention"


def _gemma3_type(cfg: Mapping[str, Any], i: int) -> str:
    # The legacy ``sliding_window_pattern`` (6 in hub configs of Gemma 3): every 6th layer is global.
    return _SLIDING if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) else _FULL


_LAYER_TYPE_RULES: Mapping[str, Callable[[Mapping[str, Any], int], str]] = MappingProxyType({
    "qwen2": _qwen2_type,
    "qwen3": _qwen2_type,
    "qwen2_moe": _qwen2_moe_type,
    "gemma2": _gemma2_type,
    "gemma3_text": _gemma3_type,
    "qwen3_next": _qwen3_next_type,
})


def derives_layer_types(config: Mapping[str, Any]) -> bool:
    """Whether transformers derives ``layer_types`` for this config's family when the list is absent."""
    return layer_config(config).get("model_type") in _LAYER_TYPE_RULES


def layer_types_of(config: Mapping[str, Any], count: int | None = None) -> list[str] | None:
    """The attention type of each layer as transformers 5 reads ``config``: its explicit ``layer_types``,
    else the family's rule for ``count`` layers (default: the declared layer count); None when neither."""
    cfg = layer_config(config)
    explicit = cfg.get("layer_types")
    if isinstance(explicit, list):
        return list(explicit)
    rule = _LAYER_TYPE_RULES.get(str(cfg.get("model_type")))
    n = count if count is not None else layer_count(cfg)
    if rule is None or n is None:
        return None
    return [rule(cfg, i) for i in range(n)]


# ---- MoE models with dense layers ----------------------------------------------------------------------------
QWEN_MOE_SCHEME = "mlp_only_layers"  # Qwen2-MoE, Qwen3-MoE, Qwen3-Next: a list plus decoder_sparse_step
PREFIX_SCHEME = "first_k_dense_replace"  # DeepSeek-V2/V3, GLM-4-MoE, LFM2-MoE: the first k layers are dense
MOE_LIST_SCHEME = "moe_layers"  # Llama-4: the list of MoE layers, else every interleave_moe_layer_step-th


def dense_mlp_layers(config: Mapping[str, Any]) -> tuple[str, frozenset[int]] | None:
    """(scheme, dense layer indices) of an MoE config whose layers are not all sparse, as transformers 5
    decides per layer (``Qwen2MoeDecoderLayer``, ``DeepseekV3DecoderLayer``, ``Llama4TextDecoderLayer``); None
    when config.json does not describe dense layers (dense models, Mixtral) or lists ``mlp_layer_types`` (a
    per-layer list instead)."""
    cfg = layer_config(config)
    n = layer_count(cfg)
    if n is None or isinstance(cfg.get("mlp_layer_types"), list):
        return None
    if "mlp_only_layers" in cfg or "decoder_sparse_step" in cfg:
        only, step = set(_layer_list(cfg, "mlp_only_layers")), _sparse_step(cfg)
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 1)) or 0)
        dense = {i for i in range(n) if i in only or not (experts > 0 and (i + 1) % step == 0)}
        return QWEN_MOE_SCHEME, frozenset(dense)
    if isinstance(cfg.get("moe_layers"), list) or type(cfg.get("interleave_moe_layer_step")) is int:
        listed = cfg.get("moe_layers")
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        moe = {int(i) for i in listed} if isinstance(listed, list) else set(range(step - 1, n, step))
        return MOE_LIST_SCHEME, frozenset(i for i in range(n) if i not in moe)
    first = cfg.get(prefix_key(cfg))
    if type(first) is int:
        return PREFIX_SCHEME, frozenset(range(min(first, n)))
    return None


def _layer_list(cfg: Mapping[str, Any], key: str) -> list[int]:
    """``cfg[key]``, a list of layer numbers (absent or null: none). Raises :class:`ModelInputError` (exit 2) for
    anything else: transformers tests ``layer_idx in`` it, which a number fails and a string answers wrongly."""
    value = cfg.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_whole(i) for i in value):
        raise ModelInputError(f"config.json says {key}: {json.dumps(value)}, where a list of layer numbers belongs (as "
                              f"[1, 3]; transformers could not build the model from it)",
                              hint=f"fix {key} in the model's config.json ([] for none)")
    return list(value)


def _sparse_step(cfg: Mapping[str, Any]) -> int:
    """``cfg``'s ``decoder_sparse_step`` (absent or null: 1, every layer sparse). Raises :class:`ModelInputError`
    (exit 2) unless a positive whole number: transformers divides the layer number by it."""
    step = cfg.get("decoder_sparse_step")
    if step is None:
        return 1
    if not is_whole(step) or step < 1:
        raise ModelInputError(f"config.json says decoder_sparse_step: {json.dumps(step)}, where a positive whole "
                              "number belongs (transformers could not build the model from it)",
                              hint="fix decoder_sparse_step in the model's config.json (1: every layer sparse)")
    return int(step)


def prefix_key(config: Mapping[str, Any]) -> str:
    """The key of a dense-prefix MoE config's count of leading dense layers: LFM2-MoE's ``num_dense_layers``,
    else ``first_k_dense_replace`` (DeepSeek, GLM)."""
    return "num_dense_layers" if type(config.get("num_dense_layers")) is int else "first_k_dense_replace"


# ---- mixing architectures ------------------------------------------------------------------------------------
def architecture_of(config: Mapping[str, Any], override: str | None = None) -> str | None:
    """The architecture name of a model: ``override_architecture`` if given, else ``architectures[0]``, else
    ``model_type``; None when config.json names neither."""
    if override:
        return override
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


def check_architectures(
    config: MergeConfig, models: Mapping[str, ModelInput], *, allow_crimes: bool
) -> None:
    """Refuse a config whose models have different architectures unless ``allow_crimes`` (mergekit's
    ``--allow-crimes``): raises a one-line :class:`ConfigError` naming the first two models that differ.

    Models whose config.json names no architecture are not compared (nothing to tell them apart by).
    """
    if allow_crimes:
        return
    overrides: dict[str, str] = {}
    paths: dict[str, str] = {}
    for ref, path in _mentions(config):
        paths.setdefault(ref.key, path)
        if ref.override_architecture and ref.key not in overrides:
            overrides[ref.key] = ref.override_architecture
    first: tuple[str, str, Mapping[str, Any], str | None] | None = None
    for ref in config.referenced_models():
        model = models.get(ref.key)
        arch = architecture_of(model.config, overrides.get(ref.key)) if model is not None else None
        if arch is None or model is None:
            continue
        if first is None:
            first = (ref.key, arch, model.config, overrides.get(ref.key))
        elif _differ(first[2], first[3], model.config, overrides.get(ref.key)):
            raise ConfigError(
                f"models have different architectures: {first[0]} is {first[1]}, {ref.key} is {arch}",
                yaml_path=paths.get(ref.key),
                hint="pass --allow-crimes to merge them tensor by tensor as names and shapes allow",
            )


def _differ(one: Mapping[str, Any], one_override: str | None, other: Mapping[str, Any],
            other_override: str | None) -> bool:
    """Whether two models' configs name different architectures: by their architecture names where both name
    one (``architectures[0]`` or an override), else by ``model_type`` — a config.json written without
    ``architectures`` (as transformers writes a config read from a GGUF file) is a ``llama`` like any
    ``LlamaForCausalLM``."""
    named = [override or (c.get("architectures") or [None])[0] for c, override in ((one, one_override),
                                                                                   (other, other_override))]
    if all(isinstance(n, str) for n in named):
        return named[0] != named[1]
    return architecture_of({"model_type": one.get("model_type")}) != architecture_of(
        {"model_type": other.get("model_type")})


def _mentions(config: MergeConfig) -> list[tuple[ModelRef, str]]:
    """Every model reference in the config with its YAML path, in YAML order."""
    found: list[tuple[ModelRef, str]] = []
    if config.base_model is not None:
        found.append((config.base_model, "base_model"))
    for src in config.all_models():
        found.append((src.model, f"{src.yaml_path}.model"))
    for sl in config.all_slices():
        if sl.base_model is not None:
            found.append((sl.base_model, f"{sl.yaml_path}.base_model"))
        found.extend((src.model, f"{src.yaml_path}.model") for src in sl.sources)
    return found

"""Where a model's tensors sit: before the layers, inside numbered layers, or after them.

The layout is inferred from tensor names, like mergekit's automatic architecture: a tensor name with a
``.<digits>.`` part belongs to a layer (prefix, index, suffix: the first numbered part counts); others are
pre-layer weights (embeddings) or post-layer weights (final norm, lm_head). Pre-layer weights come from the
first slice's models, post-layer weights from the last slice's, as mergekit does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from resumerge.errors import ModelInputError

_LAYER = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.(?P<suffix>.+)$")
# Names of loose tensors that precede the layers (token and position embeddings across families).
_PRE_MARKERS = ("embed", "wte", "wpe", "word_embeddings", "tok_embeddings")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# A model without its own lm_head contributes the tensor it is tied to (tied embeddings).
TIED_NAMES: Mapping[str, tuple[str, ...]] = {
    "lm_head.weight": ("model.embed_tokens.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight"),
}
# Per-layer lists in config.json that must follow the output's layers (transformers 5 validates their length).
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")


@dataclass(frozen=True)
class Layout:
    """A model's tensors split into pre-layer names, per-layer suffixes, and post-layer names."""

    layer_prefix: str | None
    num_layers: int
    pre: tuple[str, ...]
    layer_suffixes: tuple[str, ...]
    post: tuple[str, ...]

    def layer_name(self, index: int, suffix: str) -> str:
        """Full tensor name of ``suffix`` in layer ``index``."""
        return f"{self.layer_prefix}.{index}.{suffix}"


def split_layer_name(name: str) -> tuple[str, int, str] | None:
    """Return (prefix, layer index, suffix) for a layer tensor name, or None for a loose tensor."""
    match = _LAYER.match(name)
    if match is None:
        return None
    return match["prefix"], int(match["index"]), match["suffix"]


def infer_layout(names: Iterable[str], config: Mapping[str, Any], *, where: str) -> Layout:
    """Infer the layout of a model from its tensor ``names`` and ``config`` (config.json).

    Raises :class:`ModelInputError` when layer tensors use more than one prefix (a multi-module model) or the
    layer count in config.json disagrees with the tensors.
    """
    prefixes: dict[str, set[int]] = {}
    suffixes: list[str] = []
    loose: list[str] = []
    for name in sorted(names):
        parts = split_layer_name(name)
        if parts is None:
            loose.append(name)
            continue
        group, index, suffix = parts
        prefixes.setdefault(group, set()).add(index)
        if suffix not in suffixes:
            suffixes.append(suffix)
    if len(prefixes) > 1:
        raise ModelInputError(
            f"tensors are numbered under several prefixes ({', '.join(sorted(prefixes))})",
            path=where,
            hint="Model has multiple modules, must use modules: config syntax to work with slices",
        )
    prefix = next(iter(prefixes), None)
    found = max(prefixes[prefix]) + 1 if prefix is not None else 0
    declared = layer_count(config)
    if declared is not None and prefix is not None and declared != found:
        raise ModelInputError(
            f"config.json says {declared} layers but the weights hold layers 0..{found - 1}",
            path=where,
            hint="the model files are incomplete or config.json is wrong",
        )
    pre = tuple(n for n in loose if any(m in n for m in _PRE_MARKERS))
    post = tuple(n for n in loose if n not in pre)
    return Layout(prefix, found, pre, tuple(sorted(suffixes)), post)


def layer_count(config: Mapping[str, Any]) -> int | None:
    """The number of layers config.json declares, or None when it has no known key."""
    for key in LAYER_COUNT_KEYS:
        value = config.get(key)
        if type(value) is int:
            return value
    text = config.get("text_config")
    if isinstance(text, dict):
        return layer_count(text)
    return None


def layer_count_key(config: Mapping[str, Any]) -> str:
    """The config.json key that holds the layer count (``num_hidden_layers`` when none is present)."""
    for key in LAYER_COUNT_KEYS:
        if type(config.get(key)) is int:
            return key
    return "num_hidden_layers"

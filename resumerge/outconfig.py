"""The output config.json: the donor's config with layer count, per-layer lists, dtype and tying made true.

mergekit updates only the layer count; transformers 5 then refuses configs whose ``layer_types`` no longer
match (mergekit-semantics.md §4, defect 11). Here every per-layer list is rebuilt from the source layer of each
output layer, and ``tie_word_embeddings`` is set from whether the output actually has an lm_head.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from resumerge.architecture import PER_LAYER_KEYS, layer_count, layer_count_key

if TYPE_CHECKING:
    from resumerge.config import MergeConfig
    from resumerge.inputs import ModelInput
    from resumerge.plan import TensorPlan


def build_out_config(
    config: MergeConfig,
    models: Mapping[str, ModelInput],
    donor: str,
    origins: tuple[tuple[str, int], ...],
    tensors: Mapping[str, TensorPlan],
) -> dict[str, Any]:
    """Return the output config.json contents (a new dict; the donor's config is not modified)."""
    out: dict[str, Any] = copy.deepcopy(dict(models[donor].config))
    arch = next((s.model.override_architecture for s in _sources(config) if s.model.key == donor), None)
    if arch:
        out["architectures"] = [arch]
    target = out.get("text_config") if layer_count(out) is None and isinstance(out.get("text_config"), dict) else out
    assert isinstance(target, dict)
    target[layer_count_key(target)] = len(origins)
    for key in PER_LAYER_KEYS:
        if isinstance(target.get(key), list):
            target[key] = [_per_layer(models, donor, key, model, layer) for model, layer in origins]
    dtype = config.out_dtype or config.dtype
    if dtype is not None:
        out["dtype"] = dtype
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
    has_embed = any("embed_tokens" in n or n.endswith("wte.weight") for n in tensors)
    if has_embed and ("tie_word_embeddings" in out or "lm_head.weight" not in tensors):
        out["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return out


def render_config(out_config: Mapping[str, Any]) -> bytes:
    """Serialise config.json deterministically (2-space indent, sorted keys, trailing newline)."""
    return (json.dumps(out_config, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _per_layer(models: Mapping[str, ModelInput], donor: str, key: str, model: str, layer: int) -> Any:
    for source in (model, donor):
        cfg = models[source].config
        values = cfg.get(key)
        if not isinstance(values, list) and isinstance(cfg.get("text_config"), dict):
            values = cfg["text_config"].get(key)
        if isinstance(values, list) and layer < len(values):
            return values[layer]
    # Neither the source model nor the donor describes this layer: repeat the donor's last entry.
    return models[donor].config[key][-1] if isinstance(models[donor].config.get(key), list) else None


def _sources(config: MergeConfig) -> list[Any]:
    if config.models is not None:
        return list(config.models)
    return [s for sl in config.slices or () for s in sl.sources]

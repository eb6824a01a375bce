"""The per-layer facts of a config.json, found from what transformers' config class says is per layer.

A stack of slices must carry each output layer's facts from the source layer it was made from. Which keys of
config.json are per layer is not a list of names kept here: transformers' config class for the family is built with
two layer counts, and every list whose length follows the count is per layer (``layer_types``, ``mlp_layer_types``,
GLM-5's ``indexer_types``, Nemotron-H's ``layers_block_type``, no-RoPE flags, per-layer head counts, and whatever
the next family adds). Besides those lists, two shapes of per-layer fact are found by their form:

- a pattern string with one character per layer under a key ending in ``pattern`` (Nemotron-H's
  ``hybrid_override_pattern``, GLM-5's ``index_topk_pattern``);
- a map from layer index to that layer's overrides (Gemma 4's ``per_layer_config``, transformers'
  heterogeneous-config mapping).

Without transformers the lists are the names :data:`~resumerge.merge.plan.architecture.PER_LAYER_KEYS` holds (the build
check of :mod:`resumerge.merge.plan.buildcheck` then says it did not run). transformers is asked only where a config
holds a list of the layer count's length that those names leave out (a Llama's holds none: its keys are known without
it), and a family's answer is found once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from resumerge.merge.plan.architecture import LAYER_COUNT_KEYS, PER_LAYER_KEYS, layer_config, layer_count
from resumerge.merge.plan.keptfacts import Installed, installed, keep, kept

# The layer counts a family's config class is built with to see which of its lists follow the count: two, so that a
# list whose default length only happens to equal one of them is not taken for a per-layer one.
_PROBE_COUNTS = (5, 7)
# Per-layer values that reuse what an earlier layer of the stack computed: a stack cannot begin with one (nothing
# before it computed it). GLM-5's "shared" indexer reuses the previous "full" layer's top-k selection.
REUSES_EARLIER: tuple[tuple[str, str], ...] = (("indexer_types", "shared"),)


def class_per_layer_keys(model_type: Any) -> frozenset[str] | None:
    """The config.json keys transformers' config class for ``model_type`` holds one entry per layer in: the lists of
    its default config whose length is the layer count at two layer counts (a list of every layer's index, a
    layer-number list such as Llama-4's ``moe_layers``, excepted), and the list fields the family declares that its
    defaults leave unset (LFM2's ``layer_types``). None when transformers is not installed or does not know
    ``model_type``. Answered from resumerge's cache where an earlier plan kept the answer of the same transformers
    and torch (:mod:`resumerge.merge.plan.keptfacts`): then neither is imported."""
    versions = installed()
    if versions is None or not isinstance(model_type, str):
        return None
    return _class_keys(model_type, versions)


@functools.cache
def _class_keys(model_type: str, versions: Installed) -> frozenset[str] | None:
    """:func:`class_per_layer_keys` under transformers and torch of ``versions``: a fact of the family and the
    installed transformers alone, so found once per process (a plan asks it of each model and of its output, a search
    of each candidate's plan; each answer builds the family's config class twice) and once per installation where
    resumerge's cache keeps it (a family transformers knows and builds)."""
    known, answer = kept("per-layer-keys", model_type, versions)
    if known and isinstance(answer, list):
        return frozenset(str(k) for k in answer)
    found = _found_keys(model_type)
    if found is not None:
        keep("per-layer-keys", model_type, versions, sorted(found))
    return found


def _found_keys(model_type: str) -> frozenset[str] | None:
    """The per-layer keys transformers' config class for ``model_type`` holds (see :func:`class_per_layer_keys`)."""
    try:
        from transformers import CONFIG_MAPPING, PreTrainedConfig
    except ImportError:  # installed but broken: as where it is missing
        return None
    if model_type not in CONFIG_MAPPING:
        return None
    cls = CONFIG_MAPPING[model_type]
    own = {k: str(v) for c in cls.__mro__ if issubclass(c, PreTrainedConfig) and c is not PreTrainedConfig
           for k, v in vars(c).get("__annotations__", {}).items()}
    tracked: set[str] | None = None
    unset: set[str] | None = None
    with quiet_transformers():
        for count in _PROBE_COUNTS:
            try:
                built = cls(num_hidden_layers=count)
                doc = built.to_dict()
                total = built.num_hidden_layers
            except Exception:  # a class that cannot build its defaults: nothing learnt from it
                return None
            keys = {k for k, v in doc.items() if isinstance(v, list) and len(v) == total and v != list(range(total))}
            empty = {k for k, v in own.items() if v.startswith("list[") and doc.get(k, 0) is None}
            tracked = keys if tracked is None else tracked & keys
            unset = empty if unset is None else unset & empty
    return frozenset((tracked or set()) | (unset or set()))


def per_layer_keys(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of ``cfg`` (the layers' part of a config.json) that hold one entry per layer, sorted: the lists
    the family's config class makes per layer (:func:`class_per_layer_keys`, else the known names), pattern strings
    and layer-index maps of the layer count (:func:`source_layer_count`)."""
    count = source_layer_count(cfg)
    if count is None:
        return ()
    # transformers is asked only where ``cfg`` holds a list of the count's length that PER_LAYER_KEYS does not
    # name: it can add no other key (a Llama's config holds none; its import is seconds of a plan's start).
    unnamed = any(isinstance(v, list) and len(v) == count and k not in PER_LAYER_KEYS for k, v in cfg.items())
    listed = class_per_layer_keys(cfg.get("model_type")) if unnamed else None
    names = set(PER_LAYER_KEYS) | (listed or set())
    found = []
    for key, value in cfg.items():
        listed_here = isinstance(value, list) and key in names and len(value) == count
        pattern = isinstance(value, str) and key.endswith("pattern") and len(value) == count
        if listed_here or pattern or _layer_map(value, count):
            found.append(key)
    return tuple(sorted(found))


def same_stack(cfg: Mapping[str, Any], origins: tuple[tuple[str, int], ...]) -> bool:
    """Whether ``origins`` is the stack ``cfg`` (the donor's layers' part of config.json) describes: as many layers,
    each made from the layer of its own index (of whichever model)."""
    return all(layer == i for i, (_, layer) in enumerate(origins)) and len(origins) == layer_count(cfg)


def source_layer_count(cfg: Mapping[str, Any]) -> int | None:
    """The layer count of ``cfg``: its count key, else the length of a list the family's config class makes per
    layer, or of one :data:`PER_LAYER_KEYS` names (Nemotron-H, whose count is the length of ``layers_block_type``)."""
    declared = layer_count(cfg)
    if declared is not None or not any(isinstance(v, list) for v in cfg.values()):
        return declared  # a config without a list has no length to count by: transformers is not asked
    for key in (*sorted(class_per_layer_keys(cfg.get("model_type")) or ()), *PER_LAYER_KEYS):
        if isinstance(cfg.get(key), list):
            return len(cfg[key])
    return None


def derived_lists(cfg: Mapping[str, Any]) -> dict[str, list[Any]] | None:
    """The per-layer lists transformers' config class makes of ``cfg`` (the layers' part of a config.json), those it
    derives from other keys included (GLM-5's ``indexer_types`` from ``index_topk_freq``); None when transformers
    is not installed, does not know the family or refuses ``cfg``."""
    keys = class_per_layer_keys(cfg.get("model_type"))
    if not keys:
        return None
    from transformers import CONFIG_MAPPING

    with quiet_transformers():
        try:
            doc = CONFIG_MAPPING[cfg["model_type"]].from_dict(dict(cfg)).to_dict()
        except Exception:  # the build check says what transformers makes of a config it refuses
            return None
    return {k: list(doc[k]) for k in keys if isinstance(doc.get(k), list)}


def grown(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """A copy of config.json ``config`` with one more layer in its layers' part, a copy of its last: what tells the
    tensors that grow with the layer count; None when that part has no layer count."""
    cfg = layer_config(config)
    count = source_layer_count(cfg)
    if count is None or count < 1:
        return None
    more = dict(cfg)
    key = next((k for k in LAYER_COUNT_KEYS if type(cfg.get(k)) is int), None)
    if key is not None:
        more[key] = count + 1
    for fact in per_layer_keys(cfg):
        entries = [entry_of(cfg[fact], i) for i in range(count)]
        more[fact] = reindexed(fact, cfg[fact], [*entries, entries[-1]])
    return more if cfg is config else {**config, "text_config": more}


def reindexed(key: str, value: Any, entries: list[Any]) -> Any:
    """``value`` (a per-layer fact of the donor) rewritten from ``entries``, the output layers' entries in order
    (None: the source layer has none, which a layer-index map leaves out)."""
    if isinstance(value, str):
        return "".join(str(e) for e in entries)
    if isinstance(value, dict):
        return {str(i): e for i, e in enumerate(entries) if e is not None}
    return list(entries)


def entry_of(value: Any, layer: int) -> Any:
    """Layer ``layer``'s entry of a per-layer fact ``value`` (None when it has none)."""
    if isinstance(value, (list, str)):
        return value[layer] if layer < len(value) else None
    if isinstance(value, dict):
        return value.get(str(layer), value.get(layer))  # type: ignore[call-overload]
    return None


def _layer_map(value: Any, count: int) -> bool:
    """Whether ``value`` maps layer indices (below ``count``) to per-layer overrides."""
    return (isinstance(value, dict) and bool(value)
            and all(str(k).isdigit() and int(k) < count and isinstance(v, dict) for k, v in value.items()))


def config_of(transformers: Any, doc: Mapping[str, Any]) -> Any:
    """transformers' config object of config.json ``doc``, read as ``from_pretrained`` reads the file: the floats
    JSON cannot hold (Granite 4's ``time_step_limit`` Infinity, saved as ``{"__float__": "Infinity"}``) decoded."""
    cls = transformers.CONFIG_MAPPING[doc["model_type"]]
    decode = getattr(cls, "_decode_special_floats", None)
    return cls.from_dict(decode(dict(doc)) if decode is not None else dict(doc))


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off while a default config is built (a default that it corrects warns)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)

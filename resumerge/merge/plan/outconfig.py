"""The output config.json: the donor's config with every per-layer fact, the vocabulary, dtype and tying made true.

mergekit updates only the layer count; transformers 5 then refuses configs whose ``layer_types`` no longer
match (mergekit-semantics.md §4, defect 11), and frankenmerges of families whose layers differ (Gemma 2/3
sliding/global attention, Qwen-MoE dense layers) load with layers of the wrong kind. Here each output layer is
described by the source layer it was made from (``origins``):

- the layer count under the family's key (``num_hidden_layers``; ``n_layer`` for GPT-2 style configs; inside
  ``text_config`` for wrapper configs);
- every per-layer fact (:mod:`resumerge.merge.plan.layerfacts`: the lists transformers' config class makes per layer,
  per-layer pattern strings, layer-index override maps) rebuilt entry by entry from the source layer's entry; the
  layer count is written where the donor has a count key (Nemotron-H's is its ``layers_block_type``'s length); a
  stack whose first layer reuses an earlier layer's computation (GLM-5's "shared" indexer) is refused; Gemma 4's
  ``num_kv_shared_layers`` counts the trailing layers whose source layer shared keys and values (one sharing
  before one that does not is refused);
- ``layer_types`` written explicitly when the donor has none but its family derives one (Qwen2/3, Qwen2-MoE,
  Gemma 2, Gemma 3) and the derivation for the new layer count would give another list than the source layers
  had. ``max_window_layers`` and ``sliding_window_pattern`` are left as the donor's: transformers 5 consults them
  only when ``layer_types`` is absent, which is exactly when they still give the right list;
- MoE dense layers: Qwen-MoE ``mlp_only_layers`` becomes the output indices whose source layer was dense
  (``decoder_sparse_step`` is reset to 1 when the donor's step would make other layers dense); Llama-4
  ``moe_layers`` the output indices whose source layer had experts (written even where the donor derived it from
  ``interleave_moe_layer_step``); DeepSeek/GLM ``first_k_dense_replace`` (LFM2-MoE ``num_dense_layers``) becomes
  the number of leading dense layers, and a dense layer after a sparse one is refused, naming its slice (that
  family cannot express it);
- lists of layer numbers inside a nested config that say which layers are of one kind (Kimi-Linear's
  ``linear_attn_config`` ``kda_layers`` / ``full_attn_layers``, numbered from 1: what vLLM and the family's own
  code read where transformers reads ``layer_types``) rewritten for the output's layers (:data:`_NUMBERED`), and
  GPT-Neo's run-length ``attention_types`` written as the runs of the source layers' types;
- the MTP layer count (``num_nextn_predict_layers``) as :mod:`resumerge.merge.plan.mtp` decided;
- layer indices in ``quantization_config``'s skip lists (:mod:`resumerge.merge.plan.skiplists`);
- ``vocab_size`` from the output embedding's rows; a head whose rows differ is refused;
- ``dtype`` (and the legacy ``torch_dtype`` when present) from the output tensors' dtype;
- ``tie_word_embeddings`` from whether an output head was written, as transformers reads the checkpoint (a head
  under a name the family's conversion maps to ``lm_head``, DeepSeek-V4's ``head.weight``, is one).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from resumerge.errors import ConfigError, ModelInputError
from resumerge.merge.plan.architecture import (
    MOE_LIST_SCHEME,
    PER_LAYER_KEYS,
    PREFIX_SCHEME,
    QWEN_MOE_SCHEME,
    TIED_NAMES,
    dense_mlp_layers,
    derives_layer_types,
    is_head,
    is_input_embedding,
    layer_config,
    layer_count,
    layer_count_key,
    layer_types_of,
    prefix_key,
    unsliceable,
)
from resumerge.merge.plan.expertmodules import names_on_load
from resumerge.merge.plan.layerfacts import (
    REUSES_EARLIER,
    derived_lists,
    entry_of,
    per_layer_keys,
    reindexed,
    same_stack,
)
from resumerge.merge.plan.mtp import MtpOutcome, set_mtp_count
from resumerge.merge.plan.skiplists import set_skipped_layers

if TYPE_CHECKING:
    from resumerge.config.merge_config import MergeConfig
    from resumerge.inputs.model import ModelInput
    from resumerge.merge.plan.merge_plan import TensorPlan

# a numbered part of a tensor's name (``.3.``): a layer's, an expert's
_NUMBERED_PART = re.compile(r"\.\d+\.")
_DTYPE_NAMES = MappingProxyType({"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"})


def build_out_config(
    config: MergeConfig,
    models: Mapping[str, ModelInput],
    donor: str,
    origins: tuple[tuple[str, int], ...],
    tensors: Mapping[str, TensorPlan],
    *,
    mtp: MtpOutcome | None = None,
) -> dict[str, Any]:
    """Return the output config.json contents (a new dict; no input config is modified).

    ``origins[i]`` is the (model key, source layer) output layer ``i`` was made from; ``mtp`` what became of the
    inputs' MTP modules (None: they had none). Raises
    :class:`ConfigError` when the output's dense/MoE layer order cannot be described in the donor's config
    family, :class:`ModelInputError` when the output head and embedding have different vocabulary sizes.
    """
    out: dict[str, Any] = copy.deepcopy(dict(models[donor].config))
    arch = next((s.model.override_architecture for s in _sources(config) if s.model.key == donor), None)
    if arch:
        out["architectures"] = [arch]
    target = layer_config(out)
    assert isinstance(target, dict)
    # The donor's own stack (each output layer the layer of its index: every plain merge) keeps the lists resumerge
    # names and asks nothing of transformers; a new stack carries every per-layer fact its family's config has.
    # (a model whose stacks are all merged as modules, HRM's, has no stack of its own here: its config is kept)
    same = not origins or same_stack(layer_config(models[donor].config), origins)
    facts = tuple(k for k in PER_LAYER_KEYS if isinstance(target.get(k), list)) if same else per_layer_keys(target)
    if not same:
        _refuse_unsliceable(models, origins)
    count_key = layer_count_key(target)
    if not same and (count_key in target or not facts):  # Nemotron-H's count is its list's length: none added
        target[count_key] = len(origins)
    for key in facts:
        if key != "layer_types":
            target[key] = reindexed(key, target[key], [_per_layer(models, donor, key, m, i) for m, i in origins])
    _refuse_reuse_first(target, origins, config)
    if not same and (isinstance(target.get("layer_types"), list) or derives_layer_types(target)):
        # A source without the list (a config older than transformers' layer_types) counts with the types
        # transformers derives for it; a derived output list is written only where derivation would go wrong.
        wanted = [_layer_type(models, donor, model, layer) for model, layer in origins]
        if isinstance(target.get("layer_types"), list) or wanted != layer_types_of(target, len(origins)):
            target["layer_types"] = wanted
    if not same:
        _set_derived(target, models, origins)
        _set_numbered(target, models, origins)
        _set_run_lengths(target, models, origins)
        _set_v4_layers(target, models, donor, origins, config)
    _set_shared_kv(target, models, origins, config)
    _set_dense_layers(target, models, origins, config)
    set_mtp_count(target, mtp)
    _set_vocab(target, tensors)
    set_quantization(out, models[donor].config, tensors)
    set_skipped_layers(out, {k: m.config for k, m in models.items()}, donor,
                       origins + (mtp.origins if mtp is not None else ()))
    dtype = _tensor_dtype(tensors) or config.out_dtype or config.dtype
    if dtype is not None:
        out["dtype"] = dtype
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
    tied = _tied(out, target, list(tensors), models)
    # a donor whose config does not say (Inkling's config class has no such setting) is read as it is where its own
    # tensors put it as the output's do: written only where they differ
    said = "tie_word_embeddings" in out or "tie_word_embeddings" in target
    if tied is not None and (said or tied != _tied(out, target, list(models[donor].tensors), models)):
        out["tie_word_embeddings"] = tied
        if target is not out and "tie_word_embeddings" in target:
            target["tie_word_embeddings"] = tied
    return out


def _tied(out: Mapping[str, Any], target: Mapping[str, Any], written: Collection[str],
          models: Mapping[str, ModelInput]) -> bool | None:
    """Whether transformers must tie the head of a checkpoint of tensors ``written`` (the output's) to its
    embeddings: where no tensor written is the head as
    transformers reads the checkpoint (under any name the family's conversion maps to ``lm_head``: DeepSeek-V4's
    ``head.weight``); None where no embedding is written, or no input has a head either (Mistral 4's checkpoint, a
    base model): the donor's setting stays. transformers is asked only where the names alone show no head and the
    donor's config does not tie: a tied model's output is then tied whatever transformers says."""
    names = sorted(written)
    embedded, headed = any(is_input_embedding(n) for n in names), any(is_head(n) for n in names)
    if not headed and out.get("tie_word_embeddings", target.get("tie_word_embeddings")) is not True:
        # the tensors outside the numbered layers (a head or an embedding is one): a 90k-tensor model has a few
        loose = [n for n in names if _NUMBERED_PART.search(n) is None]
        theirs = sorted({n for m in models.values() for n in m.tensors if _NUMBERED_PART.search(n) is None}
                        - set(loose))
        read = names_on_load(out, [*loose, *theirs])
        ours = read[:len(loose)]
        embedded, headed = embedded or any(is_input_embedding(n) for n in ours), any(is_head(n) for n in ours)
        if not headed and not any(is_head(n) for n in read):
            return None
    return not headed if embedded else None


def render_config(out_config: Mapping[str, Any]) -> bytes:
    """Serialise config.json deterministically (2-space indent, sorted keys, trailing newline)."""
    return (json.dumps(out_config, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _per_layer(models: Mapping[str, ModelInput], donor: str, key: str, model: str, layer: int) -> Any:
    for source in (model, donor):
        values = layer_config(models[source].config).get(key)
        if isinstance(values, dict):  # a layer-index map: a layer it does not list has no overrides
            return entry_of(values, layer)
        if isinstance(values, (list, str)) and layer < len(values):
            return values[layer]
    # Neither the source model nor the donor describes this layer: repeat the donor's last entry.
    values = layer_config(models[donor].config).get(key)
    return values[-1] if isinstance(values, (list, str)) and values else None


def _set_derived(
    target: dict[str, Any], models: Mapping[str, ModelInput], origins: tuple[tuple[str, int], ...]
) -> None:
    """Write the per-layer lists the donor's config.json leaves for transformers to derive (GLM-5's
    ``indexer_types`` from ``index_topk_freq``) where the derivation for the output would give other entries than
    its source layers had. Needs transformers; without it the build check says it did not run."""
    derived = {key: derived_lists(layer_config(models[key].config)) for key in {m for m, _ in origins}}
    out = derived_lists(target)
    if out is None or any(d is None for d in derived.values()):
        return
    for key in sorted(out):
        if key in target:
            continue
        lists = [derived[m].get(key) for m, _ in origins]  # type: ignore[union-attr]
        wanted = [v[i] if v is not None and i < len(v) else None for v, (_, i) in zip(lists, origins)]
        if None not in wanted and wanted != out[key]:
            target[key] = wanted


# (nested config, its list of layer numbers, the first layer's number): lists naming the layers of one kind, which
# transformers' config class turns into ``layer_types`` (so the per-layer finder does not see them as lists per layer).
_NUMBERED = (("linear_attn_config", "kda_layers", 1), ("linear_attn_config", "full_attn_layers", 1))


def _set_numbered(
    target: dict[str, Any], models: Mapping[str, ModelInput], origins: tuple[tuple[str, int], ...]
) -> None:
    """Rewrite each list of layer numbers of :data:`_NUMBERED` the donor has: the output layers whose source layer
    its own config's list names."""
    for outer, inner, first in _NUMBERED:
        nested = target.get(outer)
        if not isinstance(nested, dict) or not isinstance(nested.get(inner), list):
            continue
        named = {}
        for m in {m for m, _ in origins}:
            theirs = layer_config(models[m].config).get(outer)
            named[m] = set(theirs.get(inner) or ()) if isinstance(theirs, dict) else set()
        target[outer] = {**nested, inner: [i + first for i, (m, layer) in enumerate(origins)
                                           if layer + first in named[m]]}


def _set_run_lengths(
    target: dict[str, Any], models: Mapping[str, ModelInput], origins: tuple[tuple[str, int], ...]
) -> None:
    """GPT-Neo's ``attention_types`` (runs of a pattern: ``[[["global", "local"], 6]]``, which its config class
    expands into ``attention_layers`` and checks against ``num_layers``) written as the output's runs of its source
    layers' types, and ``attention_layers`` as their list."""
    if not isinstance(target.get("attention_types"), list):
        return
    expanded = {m: _expand_runs(layer_config(models[m].config).get("attention_types")) for m in {m for m, _ in origins}}
    kinds = [expanded[m][i] if i < len(expanded[m]) else None for m, i in origins]
    if None in kinds:
        return
    runs: list[list[Any]] = []
    for kind in kinds:
        if runs and runs[-1][0] == [kind]:
            runs[-1][1] += 1
        else:
            runs.append([[kind], 1])
    target["attention_types"] = runs
    if "attention_layers" in target:
        target["attention_layers"] = kinds


def _expand_runs(runs: Any) -> list[Any]:
    """The per-layer list a run-length ``attention_types`` stands for (empty for anything else)."""
    if not isinstance(runs, list):
        return []
    out: list[Any] = []
    for item in runs:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list) and type(item[1]) is int):
            return []
        out += list(item[0]) * item[1]
    return out


def _set_v4_layers(target: dict[str, Any], models: Mapping[str, ModelInput], donor: str,
                   origins: tuple[tuple[str, int], ...], config: MergeConfig) -> None:
    """DeepSeek-V4's own keys for its layers, which its reference code and vLLM read where transformers reads the
    lists it derives from them (``layer_types``, ``mlp_layer_types``, written as every per-layer list): each output
    layer's ``compress_ratios`` entry its source layer's (the donor's entries past its layers, its MTP layers',
    after them), and ``num_hash_layers`` the number of leading output layers whose source layer is hash-routed; a
    hash-routed layer after one that is not is refused (the count cannot describe it)."""
    ratios, hashed = target.get("compress_ratios"), type(target.get("num_hash_layers")) is int
    if not isinstance(ratios, list) and not hashed:
        return
    cfgs = {m: layer_config(models[m].config) for m in {m for m, _ in origins}}
    theirs = [cfgs[m].get("compress_ratios") for m, _ in origins]
    if isinstance(ratios, list) and all(isinstance(r, list) and i < len(r) for r, (_, i) in zip(theirs, origins)):
        own = layer_count(layer_config(models[donor].config)) or len(ratios)
        target["compress_ratios"] = [r[i] for r, (_, i) in zip(theirs, origins)] + ratios[own:]  # type: ignore[index]
    if hashed:
        hash_layers = [i < int(cfgs[m].get("num_hash_layers") or 0) for m, i in origins]
        leading = next((i for i, h in enumerate(hash_layers) if not h), len(hash_layers))
        late = next((i for i in range(leading, len(hash_layers)) if hash_layers[i]), None)
        if late is not None:
            raise ConfigError(
                f"output layer {late} (layer {origins[late][1]} of {origins[late][0]}) is hash-routed but comes "
                f"after output layer {leading}, which is not, and {target.get('model_type')} configs can hash-route "
                "only the first layers (num_hash_layers)", yaml_path=slice_path(config, late),
                hint="order the slices so that every hash-routed source layer comes before the others")
        target["num_hash_layers"] = leading


def _set_shared_kv(
    target: dict[str, Any], models: Mapping[str, ModelInput], origins: tuple[tuple[str, int], ...],
    config: MergeConfig,
) -> None:
    """Gemma 4's ``num_kv_shared_layers``: the last k layers reuse the keys and values of an earlier layer (and hold
    no key or value projection). It becomes the number of trailing output layers whose source layer shared; a
    sharing layer before one that computes its own is refused (the count cannot describe it)."""
    if type(target.get("num_kv_shared_layers")) is not int:
        return
    shared = [_kv_shared(layer_config(models[m].config), i) for m, i in origins]
    trailing = len(shared) - next((i + 1 for i in reversed(range(len(shared))) if not shared[i]), 0)
    early = next((i for i in range(len(shared) - trailing) if shared[i]), None)
    if early is not None:
        raise ConfigError(
            f"output layer {early} (layer {origins[early][1]} of {origins[early][0]}) reuses an earlier layer's keys "
            f"and values but comes before output layer {len(shared) - trailing - 1}, which computes its own, and "
            f"{target.get('model_type')} configs can share them only in the last layers (num_kv_shared_layers)",
            yaml_path=slice_path(config, early),
            hint="order the slices so that every layer sharing keys and values comes after the others",
        )
    target["num_kv_shared_layers"] = trailing


def _kv_shared(cfg: Mapping[str, Any], layer: int) -> bool:
    count, shared = layer_count(cfg), cfg.get("num_kv_shared_layers")
    return type(shared) is int and count is not None and layer >= count - shared


def _refuse_unsliceable(models: Mapping[str, ModelInput], origins: tuple[tuple[str, int], ...]) -> None:
    """A stack of slices of a family whose layers are no stack a slice can cut (:func:`unsliceable`) is refused."""
    for key in sorted({m for m, _ in origins}):
        why = unsliceable(models[key].config)
        if why is not None:
            raise ConfigError(
                f"{key} is a {models[key].config.get('model_type')} model, which {why}: a stack of its layers "
                "other than its own is not a model of its family",
                yaml_path="slices",
                hint="merge it in the models: form (every layer merged with the same layer of the other models)",
            )


def _refuse_reuse_first(target: Mapping[str, Any], origins: tuple[tuple[str, int], ...], config: MergeConfig) -> None:
    """A stack whose first layer reuses what an earlier layer computed (GLM-5's "shared" indexer) is refused."""
    for key, marker in REUSES_EARLIER:
        values = target.get(key)
        if isinstance(values, list) and values and values[0] == marker:
            raise ConfigError(
                f"output layer 0 (layer {origins[0][1]} of {origins[0][0]}) has {key} {marker!r}: it reuses the "
                f"previous layer's, and the first layer of a {target.get('model_type')} stack has none before it",
                yaml_path=slice_path(config, 0),
                hint=f"begin the first slice on a layer whose {key} entry is not {marker!r}",
            )


def _layer_type(models: Mapping[str, ModelInput], donor: str, model: str, layer: int) -> str:
    for source in (model, donor):
        types = layer_types_of(models[source].config)
        if types is not None and layer < len(types):
            return types[layer]
    return "full_attention"


def _set_dense_layers(
    target: dict[str, Any], models: Mapping[str, ModelInput], origins: tuple[tuple[str, int], ...],
    config: MergeConfig,
) -> None:
    scheme = dense_mlp_layers(target)
    if scheme is None:
        return
    sources = {key: dense_mlp_layers(models[key].config) for key in {m for m, _ in origins}}
    dense = [i for i, (model, layer) in enumerate(origins) if _is_dense(sources[model], layer)]
    if scheme[1] == frozenset(dense):  # the donor's config says it already (Qwen3-MoE's decoder_sparse_step)
        return
    if scheme[0] == QWEN_MOE_SCHEME:
        step = int(target.get("decoder_sparse_step", 1) or 1)
        # With the explicit list, the donor's step may stay only if it makes no other output layer dense.
        if any((i + 1) % step for i in range(len(origins)) if i not in dense):
            target["decoder_sparse_step"] = 1
        target["mlp_only_layers"] = dense
    elif scheme[0] == MOE_LIST_SCHEME:
        target["moe_layers"] = [i for i in range(len(origins)) if i not in dense]
    elif scheme[0] == PREFIX_SCHEME:
        late = next((i for i in dense if i > 0 and i - 1 not in dense), None)
        if late is not None:
            moe_at = max(i for i in range(late) if i not in dense)
            path = slice_path(config, late)
            raise ConfigError(
                f"output layer {late} (layer {origins[late][1]} of {origins[late][0]}) is dense (no experts) but "
                f"comes after MoE output layer {moe_at}, and {target.get('model_type')} configs can describe dense "
                f"layers only at the start ({prefix_key(target)})",
                yaml_path=path,
                hint="order the slices so that every dense source layer comes before the first MoE layer",
            )
        target[prefix_key(target)] = len(dense)


def slice_path(config: MergeConfig, layer: int) -> str:
    """The YAML path of the slice that makes output ``layer`` (``slices`` when the config has no slices)."""
    start = 0
    for sl in config.slices or ():
        rng = sl.sources[0].layer_range
        start += (rng[1] - rng[0]) if rng is not None else 0
        if layer < start:
            return sl.yaml_path
    return "slices"


def _is_dense(scheme: tuple[str, frozenset[int]] | None, layer: int) -> bool:
    # A source whose config describes no dense layers (Mixtral, a dense model mixed in with crimes) is not
    # marked dense: its layer keeps whatever tensors it has.
    return scheme is not None and layer in scheme[1]


def _set_vocab(target: dict[str, Any], tensors: Mapping[str, TensorPlan]) -> None:
    names = sorted(tensors)
    embeds = [tensors[n] for n in names if is_input_embedding(n) and len(tensors[n].shape) == 2]
    # the head's own weight (lm_head.weight), not a module inside it (ModernBERT's lm_head.dense is [hidden, hidden])
    heads = [tensors[n] for n in names if n in TIED_NAMES and len(tensors[n].shape) == 2]
    if embeds and heads and embeds[0].shape[0] != heads[0].shape[0]:
        raise ModelInputError(
            f"the output embedding {embeds[0].name} has {embeds[0].shape[0]} rows but the head {heads[0].name} "
            f"(from {heads[0].inputs[0].model}) has {heads[0].shape[0]}",
            tensor=heads[0].name,
            hint="the first and last slices' models have different vocabularies: align them with "
            "tokenizer_source: base (or union, or a model name), or give one model the other's tokenizer first with "
            "resumerge tokensurgeon MODEL DONOR OUT",
        )
    rows = embeds[0].shape[0] if embeds else heads[0].shape[0] if heads else None
    if rows is not None and type(target.get("vocab_size")) is int and target["vocab_size"] != rows:
        target["vocab_size"] = rows


def set_quantization(out: dict[str, Any], base: Mapping[str, Any], tensors: Mapping[str, TensorPlan]) -> None:
    """The output's ``quantization_config``: what the output codec of its first quantized tensor (by name) says,
    from the config of the model whose format the output keeps (``base``); none when every output tensor is
    stored plainly and some input was not (``--dequantize``, or a base stored plainly), nor DeepSeek-V4's top-level
    ``expert_dtype``. A merge of plain models
    keeps the donor's config as it is. The one rule for every kind of run that writes a config.json from an
    input's (a merge, a MoE upcycling)."""
    written = next((tensors[n].out_codec for n in sorted(tensors) if not tensors[n].out_codec.plain), None)
    if written is not None:
        found = written.quantization_config(base)
        if found is not None:
            out["quantization_config"] = copy.deepcopy(dict(found))
            return
    if written is not None or any(not r.codec.plain for t in tensors.values() for r in t.inputs):
        out.pop("quantization_config", None)
        out.pop("expert_dtype", None)  # DeepSeek-V4's (fp4: its experts' storage), beside quantization_config


def _tensor_dtype(tensors: Mapping[str, TensorPlan]) -> str | None:
    # The dtype of the plainly stored tensors: a quantized one's value dtype is its codec's working precision.
    names = {_DTYPE_NAMES[t.out_dtype] for t in tensors.values() if t.out_dtype in _DTYPE_NAMES
             and t.out_codec.plain}
    return names.pop() if len(names) == 1 else None


def _sources(config: MergeConfig) -> list[Any]:
    return [*config.all_models(), *(s for sl in config.all_slices() for s in sl.sources)]

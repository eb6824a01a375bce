"""Tables packed per layer found from what transformers builds, and cut per layer for a new stack of layers.

A tensor outside the layers that holds a block for each layer (Gemma 4's ``embed_tokens_per_layer``
[vocab, layers·``hidden_size_per_layer_input``], ``per_layer_model_projection`` [layers·width, hidden]) is found
without a list of names: the donor's causal LM and the one of its config with one more layer
(:func:`~resumerge.merge.plan.layerfacts.grown`) are built on the meta device, and a tensor outside the layers whose
shape differs on one axis, by a width its size is the layer count times, is packed along that axis in blocks of that
width (the config's ``hidden_size_per_layer_input``, as transformers' modeling code reads it). One that grows
otherwise cannot be cut and is refused in one line. The answer is kept per config and installation
(:mod:`resumerge.merge.plan.keptfacts`): a later plan of the same donor imports neither transformers nor torch for it.

A stack that is not one slice over every layer of its models takes each packed table as
:class:`~resumerge.merge.plan.layerblocks.LayerBlocks`: output layer ``i``'s block from the models of the slice that
made it, at the source layer's block, merged as that slice merges the layer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resumerge.errors import ConfigError, ModelInputError
from resumerge.inputs.codecs import PLAIN
from resumerge.merge.plan.architecture import layer_config
from resumerge.merge.plan.buildcheck import LAYER_PARAM, build_meta
from resumerge.merge.plan.keptfacts import Installed, installed, keep, kept
from resumerge.merge.plan.layerblocks import LayerBlock, LayerBlocks
from resumerge.merge.plan.layerfacts import grown, quiet_transformers, source_layer_count
from resumerge.merge.plan.merge_plan import InputRef, TensorPlan, parts_bytes, stored_parts_of

if TYPE_CHECKING:
    from resumerge.merge.plan.slices import Slice


@dataclass(frozen=True)
class Packing:
    """How a table is packed: its blocks lie along ``axis``, ``width`` entries each, one per layer."""

    axis: int
    width: int


@dataclass(frozen=True)
class OutLayer:
    """Where an output layer comes from: its ``slice``, the layer of each of its sources (``layers``, in the
    slice's order) and its position ``t`` in the slice."""

    slice: Slice
    layers: tuple[int, ...]
    t: float


def packed_tables(config: Mapping[str, Any]) -> dict[str, Packing]:
    """The tensors of config.json ``config``'s model packed per layer, by name (none without transformers, or for
    a family it cannot build); raises :class:`ConfigError` for one that grows with the layer count but not in
    blocks of one width on one axis. Answered from resumerge's cache where an earlier build of the same config
    under the same transformers and torch kept it (:mod:`resumerge.merge.plan.keptfacts`): then neither is imported."""
    more = grown(config)
    count = source_layer_count(layer_config(config))
    if more is None or not count:
        return {}
    versions = installed()
    if versions is None:
        return {}
    try:
        key = json.dumps([config, more], sort_keys=True, default=repr)
    except TypeError:  # keys of mixed types, which JSON cannot sort (no config.json holds them): as they are
        key = repr([config, more])
    return dict(_packed(_Configs(key, config, more), count, versions))


@dataclass(frozen=True)
class _Configs:
    """A config.json and it grown by one layer, equal to another pair by their text (``key``) alone."""

    key: str
    config: Mapping[str, Any] = field(compare=False)
    more: Mapping[str, Any] = field(compare=False)


@functools.lru_cache(maxsize=8)
def _packed(configs: _Configs, count: int, versions: Installed) -> tuple[tuple[str, Packing], ...]:
    """:func:`packed_tables` of ``configs`` (of ``count`` layers): a fact of the config and the installed
    transformers and torch (``versions``) alone, so its two models are built on the meta device once per process (a
    search plans every candidate of every generation over the same donor; a build of a large family takes seconds)
    and once per installation where resumerge's cache can keep the answer. A refusal is raised again, not kept."""
    known, answer = kept("packed", [configs.key, count], versions)
    if known:
        return tuple((str(name), Packing(int(axis), int(width))) for name, axis, width in answer)
    found = _built(configs, count)
    if found is not None:
        keep("packed", [configs.key, count], versions, [[name, p.axis, p.width] for name, p in found])
    return found or ()


def _built(configs: _Configs, count: int) -> tuple[tuple[str, Packing], ...] | None:
    """The packed tables found from the two models transformers builds; None where it builds no causal LM of either
    config, or cannot be imported."""
    try:
        import torch
        import transformers
    except ImportError:  # installed but broken: no tables, as where it is missing
        return None
    config, more = configs.config, configs.more
    with quiet_transformers():
        built, bigger = build_meta(transformers, torch, config), build_meta(transformers, torch, more)
    if built is None or bigger is None:
        return None
    shapes = {n: tuple(p.shape) for n, p in bigger[1].named_parameters()}
    found = []
    for name, param in built[1].named_parameters():
        before, after = tuple(param.shape), shapes.get(name)
        if LAYER_PARAM.match(name) is not None or after is None or after == before:
            continue
        axes = [a for a, (x, y) in enumerate(zip(before, after)) if x != y]
        width = after[axes[0]] - before[axes[0]] if len(axes) == 1 and len(before) == len(after) else 0
        if width <= 0 or before[axes[0]] != count * width:
            raise ConfigError(
                f"{name} grows with the layer count ({list(before)} for {count} layers, {list(after)} for "
                f"{count + 1}) but not in one block per layer, so it cannot be cut for a new stack of layers",
                yaml_path="slices",
                hint="slice this model only as its whole stack of layers, in order",
            )
        found.append((name, Packing(axes[0], width)))
    return tuple(found)


def whole_stack(slices: Sequence[Slice], counts: Mapping[str, int]) -> bool:
    """Whether ``slices`` are one slice over every layer of each of its models (``counts``: layers by model), whose
    packed tables are merged whole as any other tensor."""
    return len(slices) == 1 and all(r == (0, counts[s.model.key]) for s, r in zip(slices[0].sources,
                                                                                 slices[0].ranges))


def cut_table(name: str, packing: Packing, layers: Sequence[OutLayer], counts: Mapping[str, int],
              plan_layer: Callable[[OutLayer], TensorPlan]) -> TensorPlan:
    """The plan of packed table ``name`` for the output ``layers``: ``plan_layer`` plans the whole table as an
    output layer's slice merges it (inputs, base, parameters at its ``t``), and each becomes the layer's block.
    ``counts`` are the input models' layer counts (each input's table holds as many blocks)."""
    refs: list[InputRef] = []
    firsts: list[tuple[tuple[str, Any], ...]] = []
    blocks = []
    first: TensorPlan | None = None
    for out in layers:
        tp = plan_layer(out)
        if tp.vocab_aligned or tp.experts is not None or (first is not None and tp.method != first.method):
            raise ConfigError(f"{name} holds a block for each layer and cannot be cut per layer when it is "
                              "re-indexed to a built vocabulary or merged as a non-float tensor",
                              yaml_path=out.slice.yaml_path, hint="slice this model only as its whole stack of layers")
        first = first or tp
        at = []
        for ref, params, src in zip(tp.inputs, tp.model_params, out.slice.sources):
            _check_input(name, ref, packing, counts[src.model.key], first.inputs[0], out.slice.yaml_path)
            if ref not in refs:
                refs.append(ref)
                firsts.append(params)
            at.append(refs.index(ref))
        blocks.append(LayerBlock(tuple(at), out.layers, tp.base_index, tp.model_params, tp.params))
    assert first is not None  # a stack has a layer
    shape = list(first.inputs[0].value_shape)
    shape[packing.axis] = len(layers) * packing.width
    base = blocks[0].base_index
    return TensorPlan(
        name=name, shard="", method=first.method, inputs=tuple(refs),
        base_index=None if base is None else blocks[0].inputs[base], model_params=tuple(firsts),
        params=first.params, shape=tuple(shape), compute_dtype=first.compute_dtype, out_dtype=first.out_dtype,
        nbytes=parts_bytes(stored_parts_of(name, first.out_dtype, tuple(shape), PLAIN, ())),
        blocks=LayerBlocks(packing.axis, packing.width, tuple(blocks)),
    )


def _check_input(name: str, ref: InputRef, packing: Packing, count: int, donor: InputRef, where: str) -> None:
    """Refuse an input table that is not ``count`` blocks of the packing's width, or differs from the donor's in
    its other axes."""
    shape, want = list(ref.value_shape), list(donor.value_shape)
    want[packing.axis] = shape[packing.axis] if len(shape) == len(want) else -1
    if shape != want or shape[packing.axis] != count * packing.width:
        raise ModelInputError(
            f"Tensor size mismatch for {name}: {ref.model} holds {shape}, not {count} blocks of "
            f"{packing.width} along axis {packing.axis} beside {donor.model}'s {list(donor.value_shape)}",
            yaml_path=where, tensor=name,
            hint="these models have different architectures or sizes and cannot be merged tensor by tensor",
        )

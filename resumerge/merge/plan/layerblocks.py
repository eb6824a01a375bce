"""A tensor outside the layers that holds a block for each layer (Gemma 4's ``embed_tokens_per_layer``
[vocab, layers·width] and ``per_layer_model_projection`` [layers·width, hidden]), as a stack of slices makes it.

A new stack of layers takes each output layer's block from the models of the slice that made that layer, at the
block of the source layer, merged as that slice merges the layer (its base, its parameters at the layer's ``t``).
The plan records it as :class:`LayerBlocks` on the output tensor; the engine merges block by block
(:mod:`resumerge.merge.engine.blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerBlock:
    """One output layer's block: the tensor's ``inputs`` it is merged from (indices into the tensor's inputs), the
    block of each that is taken (its source layer), the base among them (an index into ``inputs``) and the
    parameters resolved for it, as a :class:`~resumerge.merge.plan.merge_plan.TensorPlan` holds them."""

    inputs: tuple[int, ...]
    blocks: tuple[int, ...]
    base_index: int | None
    model_params: tuple[tuple[tuple[str, Any], ...], ...]
    params: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class LayerBlocks:
    """A table packed per layer along ``axis`` in blocks of ``width``: the output's blocks in layer order."""

    axis: int
    width: int
    layers: tuple[LayerBlock, ...]

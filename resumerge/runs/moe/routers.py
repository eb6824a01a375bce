"""Router (gate) weights as registered pure methods, bit for bit as mergekit-moe 0.1.5 computes them.

mergekit draws every layer's routers at once from its seeded global generator, ``(layers, gated experts,
hidden)``; each router tensor here redraws that same block from a generator seeded with the run's seed and keeps
its own layer's rows, so any one tensor can be computed (or recomputed after a kill) alone. ``cheap_embed`` sums
the prompts' token embeddings; the hidden-state modes take routers computed by :mod:`resumerge.runs.moe.forward` in a
process of its own while the rest of the merge runs: the plan names them by their content key (what the pass
depends on: the base's files, the prompts, the tokenizer, the code's versions), and the run's planning says where
they come from (a :class:`RouterSources` of the run's, in the units' context) before the engine runs.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from resumerge.machine.torch_import import torch
from resumerge.merge.methods.spec import MergeContext, MethodSpec, declared
from resumerge.runs.moe.experts import SMALL_FOOTPRINT

RANDOM = "moe_router_random"
CHEAP_EMBED = "moe_router_cheap_embed"
VALUES = "moe_router_values"

# One prompt set, tokenised: (input_ids rows, attention_mask rows), left-padded to the set's longest prompt.
Encoded = tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


def random_block(mode: str, seed: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """Every layer's routers of the ``random`` (normal) or ``uniform_random`` (nn.Linear's range) gate mode, as
    mergekit draws them after ``set_seed(seed)``: float32 ``(layers, gated experts, hidden)``."""
    generator = torch.Generator().manual_seed(seed)
    if mode == "random":
        return torch.randn(shape, generator=generator)
    scale = math.sqrt(1.0 / shape[2])
    return torch.rand(shape, generator=generator) * 2 * scale - scale


def random_router(ctx: MergeContext) -> torch.Tensor:
    """Rows ``[first, stop)`` of layer ``layer`` of :func:`random_block`."""
    p = ctx.params
    block = random_block(p["mode"], p["seed"], tuple(p["block"]))
    return block[p["layer"], p["first"]:p["stop"]].clone()


def prompt_vector(embed: torch.Tensor, encoded: Encoded) -> torch.Tensor:
    """``cheap_embed``'s vector of one prompt set: its tokens' embeddings (padding zeroed) summed over tokens and
    prompts, in float32, divided by its L2 norm; shape ``(1, hidden)``.

    Gathering rows is the one-hot product mergekit computes, exactly: every other term of each sum is zero."""
    ids, mask = torch.tensor(encoded[0], dtype=torch.int64), torch.tensor(encoded[1], dtype=torch.int64)
    h = embed[ids].float()
    summed: torch.Tensor = (h * mask.unsqueeze(-1)).sum(dim=1).sum(dim=0, keepdim=True)
    normed: torch.Tensor = summed / summed.norm(dim=-1, keepdim=True).clamp(min=1e-8)
    return normed


def cheap_embed_rows(embed: torch.Tensor, sets: Sequence[Sequence[Any]], layers: int) -> torch.Tensor:
    """Every layer's ``cheap_embed`` routers ``(layers, experts, hidden)`` from the embedding matrix and each
    expert's (positive, negative or None) encoded prompt sets."""
    vectors = []
    for positive, negative in sets:
        v = prompt_vector(embed, positive).repeat(layers, 1)
        if negative is not None:
            v -= prompt_vector(embed, negative).repeat(layers, 1)
        v /= v.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        vectors.append(v)
    return torch.stack(vectors, dim=0).permute(1, 0, 2)


def cheap_embed_router(ctx: MergeContext) -> torch.Tensor:
    """Rows ``[first, stop)`` of one layer of :func:`cheap_embed_rows` (the input is the base's embedding)."""
    p = ctx.params
    (embed,) = ctx.tensors
    return cheap_embed_rows(embed, p["sets"], 1)[0, p["first"]:p["stop"]].clone()


class RouterSources:
    """One run's sources of hidden-state routers: the content key of a prompt forward pass -> what returns its
    routers ``(layers, gated experts, hidden)``, waiting for the pass when it is still running. Filled by the
    run's planning (:mod:`resumerge.runs.moe.prepare`) before the engine runs, and handed to the router units in
    their context's :attr:`~resumerge.merge.methods.spec.MergeContext.resources`. Sent to another process (a Ray
    executor's workers), it travels as the routers themselves: a run whose executor computes elsewhere has its
    pass finished before the merge starts, so nothing waits there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, Callable[[], torch.Tensor]] = {}

    def __getstate__(self) -> dict[str, torch.Tensor]:
        with self._lock:
            return {key: source() for key, source in self._sources.items()}

    def __setstate__(self, routers: dict[str, torch.Tensor]) -> None:
        self._lock = threading.Lock()
        self._sources = {key: _Given(block) for key, block in routers.items()}

    def provide(self, key: str, routers: Callable[[], torch.Tensor]) -> None:
        """Make ``routers()`` the source of the routers of the forward pass ``key``."""
        with self._lock:
            self._sources[key] = routers

    def get(self, key: str) -> Callable[[], torch.Tensor] | None:
        """The source of the routers of the forward pass ``key``, or None when none was provided."""
        with self._lock:
            return self._sources.get(key)


class _Given:
    """Routers computed already (a :class:`RouterSources` received from another process)."""

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block

    def __call__(self) -> torch.Tensor:
        return self.block


def router_values(ctx: MergeContext) -> torch.Tensor:
    """Rows ``[first, stop)`` of layer ``layer`` of the routers the prompt forward pass ``routers`` computes (waits
    for the pass when it is still running), from the run's :class:`RouterSources`."""
    p = ctx.params
    provided = ctx.resources.find(RouterSources)
    source = provided.get(p["routers"]) if provided is not None else None
    if source is None:  # a planning bug: the run's planning provides them before the engine runs
        raise ValueError("the routers of this prompt forward pass were not provided")
    return source()[p["layer"], p["first"]:p["stop"]].clone()


def degenerate_layers(block: torch.Tensor, threshold: float = 5.0) -> list[int]:
    """The layers whose ``(experts, hidden)`` router matrix has a condition number above ``threshold``
    (mergekit-moe's test for routers that cannot tell the experts apart)."""
    return [i for i in range(block.shape[0]) if float(torch.linalg.cond(block[i].float())) > threshold]


def degenerate_note(layers: list[int], total: int) -> str | None:
    """mergekit-moe's warning for ``layers`` (of ``total``), or None when there are none."""
    if not layers:
        return None
    if len(layers) == 1:
        which = f"layer {layers[0]} has"
    elif len(layers) == 2:
        which = f"layers {layers[0]} and {layers[1]} have"
    elif len(layers) >= total:
        which = "ALL layers have"
    else:
        which = "layers " + ", ".join(map(str, layers[:-1])) + f", and {layers[-1]} have"
    return (f"{which} degenerate routing parameters - your prompts may be too similar. One or more experts will "
            "be underutilized in your model.")


# The unit functions of this module, which a MoE plan hands the engine (Plan.units).
UNITS = declared(
    MethodSpec(name=RANDOM, fn=random_router, min_inputs=0, max_inputs=0, reference="mergekit-moe router.py",
               footprint=SMALL_FOOTPRINT),
    MethodSpec(name=CHEAP_EMBED, fn=cheap_embed_router, min_inputs=1, max_inputs=1,
               reference="mergekit-moe router.py get_cheap_embedding", footprint=SMALL_FOOTPRINT),
    MethodSpec(name=VALUES, fn=router_values, min_inputs=0, max_inputs=0,
               reference="mergekit-moe router.py get_hidden_states", footprint=SMALL_FOOTPRINT),
)

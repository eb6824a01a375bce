"""A model's hidden states on fixed texts kept on disk layer by layer, and a *layer path* run from them: the shared
computation of a search over a model's structure (``evolve``'s structure genome).

A layer path is the ordered list of the model's decoder layers a candidate runs (``[0, 1, 2, 3, 2, 3, 4, 5]`` repeats
layers 2–3; ``[0, 1, 4, 5]`` skips 2–3): the model a ``slices:`` passthrough of those layer ranges writes, whose output
config gives each layer its source layer's type (:mod:`resumerge.merge.plan.outconfig`). Such a candidate equals the
base up to the first position where its path departs from ``0, 1, 2, …`` (its *departure*), so its hidden states there
are the base's: :class:`LayerCache` keeps the base's states entering every ``stride``-th layer
(``states-NNNN.safetensors``, each written durably as the base's pass reaches it, so a killed build resumes after its
last file), and :meth:`LayerCache.run_path` starts a candidate from the cached layer nearest below its departure,
running only the layers after it: a candidate repeating layers i..j−1 of N costs N − i layers (with a stride of one)
instead of N + (j − i). Each layer of the path runs with its source layer's own call (its mask, its positions: a sliding
layer stays sliding wherever it lands, as the written config says), on the texts' batches as every pass batches them
(:mod:`resumerge.forward.text.batches`). A path's entry may also be a :class:`Borrowed` layer: the layer of that number
of another model of the base's family (its weights read from that model) or of the base, its output projections scaled,
as a passthrough slice with mergekit's filtered ``scale`` writes it (:func:`scale_parameter`). A family whose layers
hand values on to later layers (:mod:`resumerge.forward.engine.handed`: GLM-5's shared indexer) is refused: a repeated
layer would hand them to the wrong one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from resumerge.errors import ModelInputError
from resumerge.forward.engine.handed import hands_on
from resumerge.forward.engine.reader import CastReader
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.journal import durable_save, latest
from resumerge.forward.job.layerpass import Reserve
from resumerge.forward.text.batches import Batch
from resumerge.machine.killpoints import reach
from resumerge.machine.torch_import import torch

PREFIX = "states-"
# What a scale multiplies in a layer: its output projections (attention's and the MLP's), as a passthrough slice's
# ``scale`` with these filters multiplies them (:func:`scale_parameter`).
SCALED = ("o_proj", "down_proj")


class Borrowed(NamedTuple):
    """A path's layer other than the base's own: decoder ``layer`` of ``source`` (0: the base; k: the k-th other
    model of its family, whose layers have the base's shapes), its output projections multiplied by ``scale``."""

    source: int
    layer: int
    scale: float = 1.0


Layer = int | Borrowed  # a path's entry: the base's layer of that number, or a borrowed or scaled one


def layer_of(entry: Layer) -> int:
    """The layer number of a path's entry (its position in its source)."""
    return entry if isinstance(entry, int) else entry.layer


def scale_parameter(scale: float) -> list[dict[str, object]]:
    """A passthrough source's ``scale`` parameter multiplying the output projections alone (mergekit's filters:
    a substring of the tensor's name; every other tensor, the embeddings and norms of a first or last slice too,
    kept as it is)."""
    return [*({"filter": name, "value": scale} for name in SCALED), {"value": 1.0}]


def departure(path: Sequence[Layer]) -> int:
    """The first position of ``path`` whose layer is not the base's layer of that position (its length where the
    path is the base's first layers, unchanged)."""
    return next((k for k, layer in enumerate(path) if layer != k), len(path))


def branch(path: Sequence[Layer], other: Sequence[Layer]) -> int:
    """The first position where ``path`` is not ``other`` (the shorter one's length where one begins the other)."""
    return next((k for k, (a, b) in enumerate(zip(path, other)) if a != b), min(len(path), len(other)))


def stride_for(layers: int, boundary_bytes: int, max_disk: int | None) -> int:
    """Every how many layers the base's states are kept so that they fit ``max_disk`` bytes (None: every layer);
    ``layers + 1`` where not even one boundary fits (nothing kept: each candidate runs from the embeddings)."""
    if max_disk is None or boundary_bytes <= 0:
        return 1
    fits = max_disk // boundary_bytes
    if fits < 1:
        return layers + 1
    return max(1, -(-layers // fits))


@dataclass
class Entered:
    """The texts' batches as the model enters them: the padded ``batches``, the hidden states entering its first
    layer (``hidden``, one tensor a batch) and each batch's call of every layer (``calls``)."""

    batches: list[Batch]
    hidden: list[torch.Tensor]
    calls: list[list[LayerCall]]

    @classmethod
    def of(cls, stream: ModelStream, batches: list[Batch]) -> Entered:
        """The embeddings and every layer's call for ``batches`` (refused for a family whose layers hand values on:
        a repeated layer would hand them to the wrong one)."""
        found = stream.inputs_of_rows(batches)
        calls = [c for _, c in found]
        if any(hands_on(call) for each in calls for call in each):
            raise ModelInputError("a structure search cannot run this family: its layers hand values on to later "
                                  "layers, which a repeated or skipped layer would hand to the wrong one")
        return cls(batches, [h for h, _ in found], calls)


class LayerCache:
    """The base's hidden states on the texts of ``entered`` entering every ``stride``-th decoder layer, kept in
    ``folder`` (see the module's docstring); ``point``: the kill point reached after each file is durable;
    ``sources``: the readers of the other models a path borrows layers from (the k-th: source k); ``written``: the
    dtype ``run`` writes a borrowed layer's weights in, each rounded to it as ``run`` rounds it (None: kept as
    read)."""

    def __init__(self, folder: Path, stream: ModelStream, entered: Entered, stride: int,
                 point: str = "after_check_layer", sources: Sequence[CastReader] = (),
                 written: torch.dtype | None = None) -> None:
        self.folder, self.stream, self.entered, self.stride, self.point = folder, stream, entered, stride, point
        self.layers = stream.layers
        self.sources = list(sources)
        self.written = written  # the dtype a merge writes a borrowed layer's weights in (None: as read)

    def kept(self, layer: int) -> bool:
        """Whether the states entering ``layer`` are kept (the embeddings, layer 0, are computed again instead)."""
        return 0 < layer <= self.layers and layer % self.stride == 0

    def last_kept(self) -> int:
        """The highest layer whose entering states the folder holds (0: none)."""
        found = latest(self.folder, PREFIX)
        return 0 if found is None else found[0]

    def built(self) -> bool:
        """Whether every boundary the stride keeps is on disk."""
        return self.last_kept() == max((b for b in range(1, self.layers + 1) if self.kept(b)), default=0)

    def build(self, reserve: Reserve, on_layer: Callable[[int], None] | None = None) -> int:
        """Run the base over its layers from the last boundary kept, keeping each boundary durably (``on_layer``:
        told each layer's index as it starts); the layers run by this call (0: the folder held them all)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stop = max((b for b in range(1, self.layers + 1) if self.kept(b)), default=0)
        start = self.last_kept()
        if start >= stop:
            return 0
        every = list(range(len(self.entered.batches)))
        hidden = self.states(start, every)
        point = self.point  # the kill point's name as tests/test_killpoints.py reads it
        for layer in range(start, stop):
            if on_layer is not None:
                on_layer(layer)
            hidden = self._layer(layer, layer, hidden, every, reserve)
            if self.kept(layer + 1):
                durable_save({f"b{b}": h for b, h in zip(every, hidden)},
                             self.folder / f"{PREFIX}{layer + 1:04d}.safetensors")
                reach(point)  # tests kill the build here: it resumes after this boundary
        return stop - start

    def states(self, layer: int, which: Sequence[int]) -> list[torch.Tensor]:
        """The base's states entering ``layer`` (a kept boundary, or 0: the embeddings) for the batches ``which``."""
        if layer == 0:
            return [self.entered.hidden[b] for b in which]
        from safetensors.torch import load_file

        found = load_file(str(self.folder / f"{PREFIX}{layer:04d}.safetensors"))
        return [self.stream.placed(found[f"b{b}"]) for b in which]

    def start_of(self, path: Sequence[Layer]) -> int:
        """The kept layer a candidate of ``path`` starts from: the highest kept one at or below its departure."""
        d = min(departure(path), self.last_kept()) if self.stride <= self.layers else 0
        return max((b for b in range(d + 1) if b == 0 or self.kept(b)), default=0)

    def run_path(self, path: Sequence[Layer], which: Sequence[int], reserve: Reserve
                 ) -> tuple[list[torch.Tensor], int]:
        """The hidden states leaving the last layer of ``path`` for the batches ``which``, and the layers run to
        get them: from the kept states nearest below the path's departure, the base's layers up to it, then the
        path's own."""
        start = self.start_of(path)
        return self.advance(path, start, len(path), self.states(start, which), which, reserve), len(path) - start

    def advance(self, path: Sequence[Layer], start: int, stop: int, hidden: list[torch.Tensor],
                which: Sequence[int], reserve: Reserve) -> list[torch.Tensor]:
        """The hidden states leaving position ``stop − 1`` of ``path``, from ``hidden`` entering position
        ``start`` (the kept states, or a path's that shares this one's layers up to ``start``: a beam's parent's)."""
        for k in range(start, stop):
            hidden = self._layer(k, path[k], hidden, which, reserve)
        return hidden

    def _layer(self, position: int, entry: Layer, hidden: list[torch.Tensor], which: Sequence[int],
               reserve: Reserve) -> list[torch.Tensor]:
        """The decoder layer ``entry`` run at ``position`` of a path on ``hidden`` (the base's layer of its number's
        call: its mask and positions, whatever the position; a borrowed layer's weights read from its source, its
        output projections scaled)."""
        layer = layer_of(entry)
        read = None if isinstance(entry, int) else self._reader(entry)
        with reserve(f"layer {layer} at position {position}", "layer"), \
                self.stream.loaded(self.stream.layers_list[layer], read=read) as module, torch.no_grad():
            return [self.stream.run(module, h, self.entered.calls[b][layer]) for h, b in zip(hidden, which)]

    def _reader(self, entry: Borrowed) -> Callable[[str], torch.Tensor]:
        """Each weight of ``entry``'s layer by checkpoint name: its source's, an output projection's multiplied by
        its scale, then rounded to the dtype the merge writes (as ``run``'s passthrough multiplies and writes it)."""
        reader = self.stream.reader if entry.source == 0 else self.sources[entry.source - 1]
        written = self.written

        def read(key: str) -> torch.Tensor:
            found = reader.read(key)
            value = found * float(entry.scale) if entry.scale != 1 and any(n in key for n in SCALED) else found
            return value if written is None else value.to(written).to(found.dtype)
        return read

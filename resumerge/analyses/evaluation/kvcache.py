"""The KV cache of a layer-streamed generation (:mod:`.streamgen`): each request's keys and values at each decoder
layer, kept between token steps while the layers come and go. Two stores behind one protocol (:class:`KVStore`):
:class:`HeldKV` holds them in RAM (where they fit the budget beside the pass's largest step), :class:`SpilledKV` in
one file in the pass's folder, read back one request's layer at a time. Either gives a request's past at a layer
(:meth:`KVStore.past`), which the step hands the layer as a transformers ``DynamicCache`` (:func:`one_layer_cache`;
a batch's, left-padded: :mod:`.rowbatch`) whose own ``update`` the layer's attention calls, exactly as in
``model.generate``; what the layer added is kept (:meth:`KVStore.keep`).

A sliding-window layer (Gemma 2/3's, Mistral's with a ``sliding_window``) keeps only the positions its window can
still see, as ``model.generate``'s windowed cache (``DynamicSlidingWindowLayer``) does: its last ``sliding_window -
1`` (:attr:`KVShape.kept`); the mask its step is given is made against a stand-in that says so (:func:`shaped_cache`),
so the keys a windowed layer attends to are the ones ``generate`` hands it, and the cache of a long generation on a
windowed family is the window's, not the whole sequence's.

Durability is the token step's (:mod:`.streamgen` journals each step in one file): :class:`HeldKV` gives the
positions a step added for that file and is rebuilt from the files on a resume; :class:`SpilledKV` writes them into
its file at their places (a windowed layer's in a ring of ``sliding_window`` slots, one more than it keeps, so that a
killed step's write never lands on a position the step run again reads; a rerun of a step writes the same bytes
there) and makes the file durable before the step's journal file is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resumerge.errors import ModelInputError
from resumerge.machine.torch_import import torch

SPILL_NAME = "kv-spill.bin"
_FLOAT = 4  # the cache's values: float32, the pass's dtype


@dataclass(frozen=True)
class KVShape:
    """A model's cache: ``layers`` decoder layers, each keeping ``heads`` key/value heads of ``width`` values per
    position; ``windows``: each layer's sliding window (0: none, every position kept; empty: no layer has one)."""

    layers: int
    heads: int
    width: int
    windows: tuple[int, ...] = ()

    def window(self, layer: int) -> int:
        """``layer``'s sliding window (0: none)."""
        return self.windows[layer] if layer < len(self.windows) else 0

    def kept(self, layer: int, positions: int) -> int:
        """The positions of a sequence ``positions`` long that ``layer`` keeps for the steps after: every one, or a
        windowed layer's last ``window - 1`` (the next query is the window's last position), as transformers'
        ``DynamicSlidingWindowLayer`` keeps them."""
        window = self.window(layer)
        return min(positions, window - 1) if window > 1 else positions

    def slots(self, layer: int, room: int) -> int:
        """The positions a spilled cache makes room for at ``layer`` for a request of ``room`` positions: all of
        them, or a windowed layer's ring of ``window`` slots (one more than it keeps: see the module)."""
        window = self.window(layer)
        return min(room, window) if window > 1 else room

    def cache_bytes(self, room: int) -> int:
        """What one request of ``room`` positions (context and new tokens) keeps in the cache, every layer's."""
        return sum(self.kept(layer, room) for layer in range(self.layers)) * self.position_bytes

    @property
    def position_bytes(self) -> int:
        """One position of one request at one layer: its keys and values."""
        return 2 * self.heads * self.width * _FLOAT

    @classmethod
    def of(cls, config: Any, layers: int) -> KVShape:
        """The cache shape of a transformers ``config``; refuses (:class:`ModelInputError`) a family one of whose
        layers keeps anything but keys and values (a recurrent or linear-attention state, a chunked window): the
        streamed generation keeps those only. A sliding-window layer (Gemma 2/3's, Mistral's with a
        ``sliding_window``) keeps every position here too: the mask its step is given hides those outside its window
        (:func:`shaped_cache`), as ``model.generate``'s windowed cache leaves them out."""
        from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

        layers_made = DynamicCache(config=config).layers
        kinds = {type(layer).__name__ for layer in layers_made
                 if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)}
        if kinds:
            raise ModelInputError(f"its layers keep a {', '.join(sorted(kinds))} cache; a layer-streamed generation "
                                  "keeps keys and values only",
                                  hint="raise --max-memory so that the whole model fits: it generates held whole")
        text = config.get_text_config()
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        width = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        windows = tuple(int(layer.sliding_window) if isinstance(layer, DynamicSlidingWindowLayer) else 0
                        for layer in layers_made)
        return cls(layers, heads, width, windows if any(windows) else ())


def shaped_cache(config: Any, past: int) -> Any:
    """A ``DynamicCache`` that says it holds ``past`` positions at every layer and holds no memory (its keys and
    values a zero broadcast): what the model's own forward reads to make a step's positions and mask. A windowed
    layer says what ``model.generate``'s would after ``past`` positions: it has seen them all and holds the last
    ``sliding_window - 1`` (:meth:`KVShape.kept`), so the family's window mask is made for exactly the keys the store
    hands the layer (:meth:`KVStore.past`)."""
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    if past:
        zero = torch.zeros((), dtype=torch.float32)
        for layer in cache.layers:
            windowed = isinstance(layer, DynamicSlidingWindowLayer)
            held = min(past, layer.sliding_window - 1) if windowed and layer.sliding_window > 1 else past
            shaped = zero.expand(1, 1, held, 1)
            layer.lazy_initialization(shaped, shaped)
            layer.keys, layer.values = shaped, shaped
            if windowed:  # what it has seen, which its mask's offset and the positions are made from
                layer.cumulative_length = past
    return cache


def one_layer_cache(layer: int, past: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device) -> Any:
    """A ``DynamicCache`` whose layer ``layer`` holds ``past`` (keys, values; None: nothing yet) on ``device``."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    while len(cache.layers) <= layer:
        cache.layers.append(cache.layer_class_to_replicate())
    if past is not None:
        keys, values = (t.to(device) for t in past)
        cache.layers[layer].lazy_initialization(keys, values)
        cache.layers[layer].keys, cache.layers[layer].values = keys, values
    return cache


class KVStore(Protocol):
    """Where a generation's KV cache is kept between token steps."""

    def past(self, layer: int, request: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``request``'s keys and values at ``layer`` (each ``(1, heads, positions, width)``, on the host; None:
        none yet)."""

    def keep(self, layer: int, request: int, keys: torch.Tensor, values: torch.Tensor, added: int) -> None:
        """``request``'s keys and values at ``layer`` once the layer ran (its past and the ``added`` positions it
        added, each ``(1, heads, positions, width)``)."""

    def step_done(self) -> dict[str, torch.Tensor]:
        """The step's positions made durable here, or returned for the step's journal file (named by layer and
        request)."""

    def restore(self, journaled: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """The store as the journaled steps left it (each step's file's tensors, in order)."""

    def close(self, remove: bool) -> None:
        """Its files closed (and removed: the generation is done)."""


class HeldKV:
    """The cache in RAM: per layer and request, the keys and values (host tensors; a windowed layer's last
    ``window - 1`` positions, ``shape``'s)."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.added: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _windowed(self, layer: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s positions that ``layer`` keeps (a windowed layer's last ``window - 1``)."""
        window = self.shape.window(layer)
        return tensor[:, :, -(window - 1):] if window > 1 else tensor

    def past(self, layer: int, request: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.held.get((layer, request))

    def keep(self, layer: int, request: int, keys: torch.Tensor, values: torch.Tensor, added: int) -> None:
        # its own copy: a batch's row would hold the whole batch's tensor (and a window's slice its whole sequence)
        keys = self._windowed(layer, keys).to("cpu").contiguous()
        values = self._windowed(layer, values).to("cpu").contiguous()
        self.held[(layer, request)] = (keys, values)
        self.added[(layer, request)] = (keys[:, :, -added:], values[:, :, -added:])

    def step_done(self) -> dict[str, torch.Tensor]:
        found = {}
        for (layer, request), (keys, values) in self.added.items():
            found[f"k.{layer}.{request}"] = keys.contiguous()
            found[f"v.{layer}.{request}"] = values.contiguous()
        self.added = {}
        return found

    def restore(self, journaled: Sequence[Mapping[str, torch.Tensor]]) -> None:
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for step in journaled:  # step by step, a windowed layer's cut to its window as it grows
            for name, keys in step.items():
                kind, layer, request = name.split(".") if name.count(".") == 2 else ("", "", "")
                if kind == "k":
                    at, values = (int(layer), int(request)), step[f"v.{layer}.{request}"]
                    if at in held:
                        keys, values = torch.cat([held[at][0], keys], dim=2), torch.cat([held[at][1], values], dim=2)
                    held[at] = (self._windowed(at[0], keys).contiguous(), self._windowed(at[0], values).contiguous())
        self.held = held

    def close(self, remove: bool) -> None:
        self.held, self.added = {}, {}


class SpilledKV:
    """The cache in one file in ``folder`` (:data:`SPILL_NAME`): per layer, request, keys then values, room for
    ``shape.slots(layer, room[r])`` positions of request r (a windowed layer's a ring: position p in slot p modulo
    its size), each position's heads side by side. A layer's past is read when it runs and let go after; what it
    adds is written at its place."""

    def __init__(self, folder: Path, shape: KVShape, room: Sequence[int]) -> None:
        self.shape, self.room = shape, list(room)
        self.row = shape.heads * shape.width * _FLOAT  # one position's keys (or values) at one layer
        self.slots = [[shape.slots(layer, r) for r in room] for layer in range(shape.layers)]
        self.starts: list[list[int]] = []
        at = 0
        for layer in range(shape.layers):
            self.starts.append([])
            for slots in self.slots[layer]:
                self.starts[-1].append(at)
                at += 2 * slots * self.row
        self.lengths: dict[tuple[int, int], int] = {}
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / SPILL_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def _at(self, layer: int, request: int, values: bool) -> int:
        return self.starts[layer][request] + (self.slots[layer][request] * self.row if values else 0)

    def _runs(self, layer: int, request: int, first: int, end: int) -> list[tuple[int, int, int]]:
        """Positions ``first`` to ``end`` (excluded) as runs of slots in the ring: (slot, position, count) each."""
        slots = self.slots[layer][request]
        runs, position = [], first
        while position < end:
            slot = position % slots
            count = min(end - position, slots - slot)
            runs.append((slot, position, count))
            position += count
        return runs

    def _read(self, at: int, positions: int) -> torch.Tensor:
        found = torch.empty(positions, self.shape.heads, self.shape.width, dtype=torch.float32)
        view = memoryview(found.numpy().data).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got <= 0:
                raise ModelInputError(f"{self.path} ends before the KV cache it holds",
                                      hint=f"delete {self.path.parent} and generate again")
            done += got
        return found

    def past(self, layer: int, request: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        length = self.lengths.get((layer, request), 0)
        if not length:
            return None
        first = length - self.shape.kept(layer, length)
        found = []
        for second in (False, True):
            base = self._at(layer, request, second)
            parts = [self._read(base + slot * self.row, count)
                     for slot, _, count in self._runs(layer, request, first, length)]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            found.append(rows.permute(1, 0, 2).unsqueeze(0))  # (1, heads, positions, width), as the cache holds it
        return found[0], found[1]

    def keep(self, layer: int, request: int, keys: torch.Tensor, values: torch.Tensor, added: int) -> None:
        length = self.lengths.get((layer, request), 0) + added
        held = int(keys.shape[2])  # the last ``held`` positions of ``length``
        first = max(length - added, length - held, length - self.slots[layer][request])
        for tensor, second in ((keys, False), (values, True)):
            base = self._at(layer, request, second)
            for slot, position, count in self._runs(layer, request, first, length):
                at = held - (length - position)
                rows = tensor[0, :, at:at + count].to("cpu").permute(1, 0, 2).contiguous()
                os.pwrite(self.fd, rows.numpy().tobytes(), base + slot * self.row)
        self.lengths[(layer, request)] = length
    def step_done(self) -> dict[str, torch.Tensor]:
        os.fsync(self.fd)
        return {}

    def restore(self, journaled: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """The lengths the journaled steps reached (their tokens say: each step added a request's positions at every
        layer), the file's positions up to them durable since."""
        for step in journaled:
            for name, added in step.items():
                if name.startswith("added."):
                    request = int(name.split(".")[1])
                    for layer in range(self.shape.layers):
                        self.lengths[(layer, request)] = self.lengths.get((layer, request), 0) + int(added)

    def close(self, remove: bool) -> None:
        os.close(self.fd)
        if remove:
            self.path.unlink(missing_ok=True)

"""Where a pass's models run: the :class:`Placement` protocol, and :class:`Streams`, every model in this process,
one layer of one model at a time, each admitted by the pass's :data:`~resumerge.forward.job.layerpass.Reserve`. A Ray
cluster is another placement, an actor per model (:mod:`resumerge.forward.placing.rayactor`); a client's
:class:`~resumerge.forward.job.layerpass.Step` drives either the same way, so its journal is the same file whichever
ran it. A pass whose models the executor places elsewhere is handed a :class:`Places`, and never learns where.

At layer l each model's layer is read once and run on that model's own hidden states and, where the pass asks, on
a reference model's input to the layer too (``check``'s localising pass): :func:`model_layer`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Protocol

from resumerge.forward.engine import handed
from resumerge.forward.engine.padding import pads_alike
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.layerpass import Reserve, unreserved
from resumerge.forward.text.batches import Batch, Hidden
from resumerge.machine.torch_import import torch

if TYPE_CHECKING:
    from resumerge.forward.opening.opened import PassModel


class Placement(Protocol):
    """Where the pass's models run, model by model (the first one first)."""

    @property
    def layers(self) -> int: ...

    def enter(self, batches: list[Batch]) -> Hidden:
        """Each model's hidden states entering its first decoder layer, per batch (their layers' calls kept)."""

    def runs_batched(self) -> bool:
        """Whether the first model's first layer runs the batches :meth:`enter` was given (:func:`batched_on`)."""

    def before(self) -> int:
        """How many positions the first model's layers' hidden states hold before the tokens' (CPM-Ant's prompt)."""

    def layer(self, index: int, hidden: Hidden, reference: int | None, same: list[torch.Tensor] | None = None
              ) -> tuple[Hidden, Hidden]:
        """Each model's layer ``index`` on its own ``hidden`` states and on the reference's input to the layer
        (``same`` where given, else :meth:`entered`; its own output where it is the reference or there is none):
        both, per model."""

    def entered(self, index: int, hidden: Hidden, m: int) -> list[torch.Tensor]:
        """Model ``m``'s input to its layer ``index`` as its forward gives it, per batch, its last outputs
        ``hidden[m]``: what the forward computes before the layer from earlier outputs (a residual sum between two
        parts, a loop's start) computed again, where it computes anything (:meth:`ModelStream.entered`)."""

    def carried(self, index: int) -> dict[str, torch.Tensor]:
        """What the layers up to ``index`` hand later ones beside the hidden states, for the pass's journal
        (:mod:`resumerge.forward.engine.handed`; the rest dropped)."""

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back what :meth:`carried` journaled (a resumed pass)."""


class Places(Protocol):
    """Where the run's executor places a pass's models, handed to a pass that does not learn where (the MoE
    hidden-state gates'): ``(models, layers, needs, dtype)`` -> a context holding the :class:`Placement` of
    ``models`` (``layers`` decoder layers each, read in ``dtype``; ``needs``: the memory each model's part of the
    pass holds at its largest step), refused (:class:`~resumerge.errors.UsageError`, exit 2) before any weight is
    read where they cannot be placed; what runs them ends with the block. An actor per model on a Ray cluster:
    :func:`resumerge.forward.placing.rayactor.placing`."""

    def __call__(self, models: Sequence[PassModel], layers: int, needs: Sequence[int],
                 dtype: torch.dtype) -> AbstractContextManager[Placement]: ...


class Watch(Protocol):
    """What a pass observes of each model's layer as it is read and run (``check``'s static figures taken from the
    layers' reads, ``measure``'s Grams): the order the models run in, a context around one model's layer, and the
    end of a layer."""

    def order(self, models: int) -> Iterable[int]: ...

    def watching(self, stream: ModelStream, m: int, module: torch.nn.Module) -> AbstractContextManager[object]: ...

    def end_layer(self) -> None: ...


class NodeWatch(Watch, Protocol):
    """A :class:`Watch` whose findings the pass's step takes after each layer (``measure``'s Grams), computed where
    the layer runs: in this process (:class:`Streams` runs this very watch), or on the model's node, where its actor
    runs a copy of it (sent as it is: it pickles) and the placement puts what the copy found back into this one
    (:class:`~resumerge.forward.placing.rayactor.RayModels`). A watch of what this process reads (``check``'s static
    figures) is a plain :class:`Watch`: it runs only where the layers are read here."""

    def taken(self, m: int) -> object:
        """What it found of model ``m``'s layer run last, forgotten here."""

    def put(self, m: int, found: object) -> None:
        """What a copy of it found of model ``m``'s layer where that ran, for :meth:`taken`."""


class Streams:
    """The pass's models run in this process, one layer of one model at a time: ``streams`` (each model's
    modules), ``reserve`` admitting each model's layer (step ``layer``), ``on_model(layer, m)`` told before model
    ``m``'s layer is read, ``watch`` observing the layers, ``own_batches(m, batches)`` the batches as model ``m``
    reads them (its own token ids, where the models' vocabularies differ); ``names``: each model as its steps'
    admissions name it (None: ``model 1``, ``model 2``...); ``rows``: the input embeddings read only in the rows
    the batches use (:meth:`~resumerge.forward.engine.stream.ModelStream.inputs_of_rows`; False: the whole table, as a
    pass that reads each byte of its models for their proof, ``measure``'s, reads it)."""

    def __init__(self, streams: Sequence[ModelStream], on_model: Callable[[int, int], None] | None = None,
                 reserve: Reserve = unreserved, watch: Watch | None = None,
                 own_batches: Callable[[int, list[Batch]], list[Batch]] | None = None,
                 names: Sequence[str] | None = None, rows: bool = True) -> None:
        self.streams, self.on_model, self.reserve, self.watch = streams, on_model, reserve, watch
        self.own_batches, self.rows = own_batches, rows
        self.names = list(names) if names is not None else [f"model {m + 1}" for m in range(len(streams))]
        self.layers = streams[0].layers
        self.entering: list[tuple[torch.Tensor, list[LayerCall]]] = []
        self.calls: list[list[list[LayerCall]]] = []
        self.batches: list[Batch] = []  # the first model's own ids, for runs_batched

    def enter(self, batches: list[Batch]) -> Hidden:
        own = [batches if self.own_batches is None else self.own_batches(m, batches) for m in range(len(self.streams))]
        entering = [stream.inputs_of_rows(own[m]) if self.rows else stream.inputs(own[m])
                    for m, stream in enumerate(self.streams)]
        self.batches = own[0]
        self.entering = entering[0]
        self.calls = [[c for _, c in model] for model in entering]
        return [[h for h, _ in model] for model in entering]

    def runs_batched(self) -> bool:
        return runs_batched(self.streams[0], self.entering, self.reserve, self.batches)

    def before(self) -> int:
        return self.streams[0].tail.positions_before()

    def layer(self, index: int, hidden: Hidden, reference: int | None, same: list[torch.Tensor] | None = None
              ) -> tuple[Hidden, Hidden]:
        same_input = (same if same is not None else self.entered(index, hidden, reference)) \
            if reference is not None else None
        n = len(self.streams)
        own: Hidden = [[] for _ in range(n)]
        on_same: Hidden = [[] for _ in range(n)]
        order = list(self.watch.order(n) if self.watch is not None else range(n))
        for k, m in enumerate(order):
            stream = self.streams[m]
            self._prefetch(index, order, k)
            if self.on_model is not None:
                self.on_model(index, m)
            module = stream.layers_list[index]
            watching = self.watch.watching(stream, m, module) if self.watch is not None else nullcontext()
            with self.reserve(f"layer {index} of {self.names[m]}", "layer"), watching:
                out, theirs = model_layer(stream, index, hidden[m], self.calls[m],
                                          None if m == reference else same_input)
            own[m] = out
            on_same[m] = out if theirs is None else theirs
        if self.watch is not None:
            self.watch.end_layer()
        return own, on_same

    def entered(self, index: int, hidden: Hidden, m: int) -> list[torch.Tensor]:
        return model_entered(self.streams[m], index, hidden[m], self.calls[m])

    def _prefetch(self, index: int, order: list[int], k: int) -> None:
        """The layer read after the ``k``-th of layer ``index``'s ``order`` (the next model's, else the next layer's
        first model's), asked of the kernel while this one is read and run (:meth:`CastReader.prefetch`)."""
        m, layer = (order[k + 1], index) if k + 1 < len(order) else (order[0], index + 1)
        if layer < self.layers:
            stream = self.streams[m]
            stream.reader.prefetch(stream.prefix(stream.layers_list[layer]))

    def carried(self, index: int) -> dict[str, torch.Tensor]:
        """What a later layer takes of what the layers up to ``index`` returned beside their hidden states, for the
        journal (:mod:`resumerge.forward.engine.handed`; the rest dropped)."""
        return handed.carried(self.calls, index)

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back what :meth:`carried` journaled (a resumed pass)."""
        handed.restore(self.calls, tensors)


def runs_batched(stream: ModelStream, entering: list[tuple[torch.Tensor, list[LayerCall]]],
                 reserve: Reserve = unreserved, batches: list[Batch] | None = None) -> bool:
    """Whether the model's first decoder layer runs a padded batch (some families' attention, as transformers
    ships it, cannot: DeepSeek-V3's with a padding mask) and gives each sequence what it gives it alone
    (DeepSeek-V3.2's indexer does not); decided from the model alone, so a resumed pass decides the same."""
    with reserve("layer 0 of model 1 (can it run batches?)", "layer"), stream.loaded(stream.layers_list[0]) as layer:
        return batched_on(stream, layer, entering, batches)


def batched_on(stream: ModelStream, layer: torch.nn.Module, entering: list[tuple[torch.Tensor, list[LayerCall]]],
               batches: list[Batch] | None = None) -> bool:
    """Whether the model's first decoder ``layer`` (its weights loaded) runs every padded batch of ``entering``
    and, given the ``batches`` (ids, mask) they come from, gives each sequence what it gives it alone
    (:func:`~resumerge.forward.engine.padding.pads_alike`)."""
    try:
        outputs = [stream.run(layer, hidden, calls[0]) for hidden, calls in entering]
    except RuntimeError:
        return False
    return batches is None or pads_alike(stream, layer, batches, entering, outputs)


def model_entered(stream: ModelStream, index: int, own: list[torch.Tensor], calls: list[list[LayerCall]]
                  ) -> list[torch.Tensor]:
    """One model's input to its layer ``index`` as its forward gives it, per batch, its last outputs ``own``
    (:meth:`ModelStream.entered`)."""
    return [stream.entered(h, calls[s][index], index) for s, h in enumerate(own)]


def model_layer(stream: ModelStream, index: int, own: list[torch.Tensor], calls: list[list[LayerCall]],
                same: list[torch.Tensor] | None, loaded: bool = False
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One model's layer ``index``, read once: its output on its ``own`` hidden states (per batch) and, unless
    ``same`` is None, on ``same`` (the reference's input to the layer). Where ``same`` equals ``own`` to the bit
    (the first layer of models with the same embeddings) its output is the same and is not computed twice.
    ``loaded``: the layer holds its weights already (read for another step, not read again); it is left without
    them, as after a read."""
    # (a layer given more than the previous output, :meth:`ModelStream.entered`, is given other input than ``own``)
    equal = same is not None and all(getattr(calls[s][index], "entering", None) is None for s in range(len(own))) \
        and all(a is b or torch.equal(a, b) for a, b in zip(own, same))
    module = stream.layers_list[index]
    with _seeded(stream, index), held(stream, module) if loaded else stream.loaded(module) as layer:
        out = [stream.run(layer, h, calls[s][index]) for s, h in enumerate(own)]
        theirs = None if same is None or equal else [stream.run(layer, h, calls[s][index], hand_on=False)
                                                      for s, h in enumerate(same)]
    return out, out if equal else theirs


@contextmanager
def _seeded(stream: ModelStream, index: int) -> Iterator[None]:
    """torch's generators seeded by layer step ``index`` for the block, as they were after it: a layer that draws at
    random (Reformer's LSH attention hashes with fresh rotations where no hash_seed fixes them) draws the same
    numbers in every model, and again where a resumed pass runs it. Seeded are the generators the block puts back:
    the CPU's and, for a layer on a GPU, that GPU's. (``torch.manual_seed`` seeds every device's and, for each kind
    of device not yet initialised, queues the seed with its caller's formatted stack: 2-6 ms a layer step, more than
    a tiny model's layer, and a seed left for a GPU first used after the pass.)"""
    gpu = [stream.device.index or 0] if stream.device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpu):
        torch.default_generator.manual_seed(index)
        for device in gpu:  # initialised by fork_rng, which read its state
            with torch.cuda.device(device):
                torch.cuda.manual_seed(index)
        yield


@contextmanager
def held(stream: ModelStream, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module``, whose weights are loaded already, for the block; without them after."""
    try:
        yield module
    finally:
        stream.unload(module)

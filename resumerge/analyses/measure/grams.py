"""One model's Gram matrices, measured one decoder layer at a time on the forward engine (``resumerge measure``).

Each decoder layer is read, run over every token sequence with a hook before each of its linears that adds x·xᵀ
over the sequence's positions to a float64 sum, and dropped. A linear whose input is the very tensor another
linear of the layer received (q/k/v, gate/up) shares that one's Gram: it is summed once and stored once. After the
layer, its Grams (the sums over the token count, float32) go to the layer's file and the hidden states leaving it
to the journal, each durably (temp file, fsync, rename); the journal's older file is then deleted. A killed pass
resumes after the last journaled layer and writes the same bytes: a layer is computed from the same float32
hidden states in the same order (the file of a layer computed again is replaced by an identical one).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from resumerge.errors import ModelInputError
from resumerge.forward.batches import Batch, Hidden
from resumerge.forward.handed import Held
from resumerge.forward.journal import Journal, durable_save
from resumerge.forward.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.inputs.grams import METADATA_KEY, layer_file
from resumerge.torch_import import torch

HIDDEN_PREFIX = "hidden-"
# A mixture of experts' layer file also holds, float64, each fused experts stack's sums of squared inputs per expert
# ([E, n_in], by the stack's checkpoint name) and each experts module's tokens routed to each expert ([E]), the
# importance matrix's entries (``measure --imatrix``) of weights that have no Gram.
EXPERT_SUMS = "expert-sums:"
EXPERT_COUNTS = "expert-counts:"


class _Recorder:
    """The hooks on one layer's linears: each distinct input's float64 Σ x·xᵀ, and which linear's sum each
    linear shares (found on the first sequence, the same for every sequence: one module's code)."""

    def __init__(self, linears: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.shares: dict[str, str] = {}
        self._seen: list[tuple[torch.Tensor, str]] = []  # this sequence's inputs, held: no address is reused
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in linears]

    def _hook(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...]], None]:
        def observe(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            owner = self.shares.get(name)
            if owner is None:
                owner = next((seen_name for seen, seen_name in self._seen if seen is x), name)
                self.shares[name] = owner
            self._seen.append((x, name))
            if owner != name:
                return
            flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
            found = self.sums.get(name)
            if found is None:
                self.sums[name] = flat.T @ flat
            else:
                found.addmm_(flat.T, flat)

        return observe

    def next_sequence(self) -> None:
        self._seen.clear()

    def close(self) -> None:
        self._seen.clear()
        for handle in self._handles:
            handle.remove()


def linears_of(layer: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Module]]:
    """Every ``torch.nn.Linear`` of ``layer`` by its checkpoint module name (``prefix`` + its name in the layer)."""
    return [(prefix + name, module) for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)]


class Runner(Protocol):
    """Where one model's measured pass runs: this process (:class:`Streamed`), or a Ray actor of its own
    (:mod:`.onray`). The Grams it gives are written, and the hidden states journaled, by this process alike, so a
    measurement started on one resumes on the other with the same bytes."""

    @property
    def layers(self) -> int: ...

    @property
    def what(self) -> str: ...

    def enter(self, batches: list[Batch]) -> list[torch.Tensor]:
        """The hidden states entering the first decoder layer, per batch (the layers' calls kept)."""

    def layer(self, index: int, hidden: list[torch.Tensor], tokens: int) -> Recorded:
        """Layer ``index`` run on ``hidden`` with its linears' inputs recorded (:func:`_recorded_layer`)."""

    def carried(self, index: int) -> dict[str, torch.Tensor]:
        """What the layers up to ``index`` hand later ones beside the hidden states, for the pass's journal
        (:mod:`resumerge.forward.handed`, named as model 0's)."""

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back what :meth:`carried` journaled (a resumed pass)."""


# A layer's outputs, its float32 Grams by the linear holding each, and which linear holds each linear's Gram (a
# string: this module is imported where torch is not, and annotations are not evaluated).
Recorded: TypeAlias = "tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, str]]"


class Streamed:
    """A model's measured pass in this process, on its ``stream``."""

    def __init__(self, stream: ModelStream) -> None:
        self.stream = stream
        self.calls: list[list[LayerCall]] = []

    @property
    def layers(self) -> int:
        return self.stream.layers

    @property
    def what(self) -> str:
        return str(self.stream.reader.directory)

    def enter(self, batches: list[Batch]) -> list[torch.Tensor]:
        with torch.no_grad():
            entering = self.stream.inputs(batches)
        self.calls = [c for _, c in entering]
        return [h for h, _ in entering]

    def layer(self, index: int, hidden: list[torch.Tensor], tokens: int) -> Recorded:
        return _recorded_layer(self.stream, index, hidden, self.calls, tokens)

    def carried(self, index: int) -> dict[str, torch.Tensor]:
        return Held(lambda: [self.calls]).carried(index)

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        Held(lambda: [self.calls]).restore(tensors)


def measure_model(runner: Runner, batches: list[Batch], out: Path, index: int, journal: Path, *,
                  on_layer: Callable[[int], None] | None = None, reserve: Reserve = unreserved) -> None:
    """Write the Gram file of each decoder layer of the model ``runner`` runs (the ``index``-th measured model) under
    ``out``, journaling the hidden states in ``journal`` and resuming after the last layer journaled there, on the
    one journaled layer pass (:class:`~resumerge.forward.layerpass.LayerPass`, kill point ``after_measure_layer``
    once a layer is durable). ``on_layer(l)`` is told before layer l is read, ``reserve`` admits each layer's
    step (``layer``). Nothing is done for a model whose
    last layer's file is there already: its pass had finished."""
    layers = runner.layers
    if (out / layer_file(index, layers - 1)).is_file():
        return
    (out / layer_file(index, 0)).parent.mkdir(parents=True, exist_ok=True)
    tokens = sum(int(mask.sum()) for _, mask in batches)
    entering = runner.enter(batches)
    step = _ModelStep(runner, tokens, lambda layer: out / layer_file(index, layer), on_layer, reserve)
    kept = _journal(journal)
    LayerPass(kept, layers, point="after_measure_layer", carries=runner).run(step, [entering], len(batches))
    kept.remove()


def _journal(folder: Path) -> Journal:
    """A measurement's journal: the hidden states leaving each layer (one model's: ``hidden.<batch>``)."""
    return Journal(folder, HIDDEN_PREFIX, hidden="hidden.{s}")


class _ModelStep(Step[None]):
    """One model's Grams: each layer run over every sequence with its linears' inputs recorded, its Gram file
    written (``path(layer)``) before the hidden states leaving it are journaled."""

    def __init__(self, runner: Runner, tokens: int, path: Callable[[int], Path],
                 on_layer: Callable[[int], None] | None, reserve: Reserve) -> None:
        self.runner, self.tokens, self.path, self.on_layer = runner, tokens, path, on_layer
        self.reserve = reserve

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        if self.on_layer is not None:
            self.on_layer(index)
        with self.reserve(f"layer {index} of {self.runner.what}", "layer"):
            out, grams, shares = self.runner.layer(index, hidden[0], self.tokens)
            _save(grams, shares, self.tokens, self.path(index))
            return [out]

    def finish(self, hidden: Hidden) -> None:
        return None


def _recorded_layer(stream: ModelStream, index: int, hidden: list[torch.Tensor], calls: list[list[LayerCall]],
                    tokens: int) -> Recorded:
    """Layer ``index`` of ``stream`` run over every sequence with its linears' inputs recorded: its outputs, the
    float32 Grams by the linear holding each, and which linear holds each linear's Gram."""
    from resumerge.forward.routed import RoutedSums, fused_experts, routers

    module = stream.layers_list[index]
    with stream.loaded(module) as layer:
        prefix = stream.prefix(module)
        linears = linears_of(layer, prefix)
        if not linears:
            raise ModelInputError(f"decoder layer {index} of {type(stream.model).__name__} has no torch.nn.Linear to "
                                  "measure (GPT-2's Conv1D, for one, is not measured yet)",
                                  path=str(stream.reader.directory))
        # A mixture of experts' layer (measured for --imatrix): its routers (matrices over the hidden states that
        # are not nn.Linear) get Grams as linears do, and its fused experts the importance pass's per-expert sums
        # and counts (what llama-imatrix records of a MUL_MAT_ID: no Gram of one expert's inputs is kept).
        experts = fused_experts(layer)
        recorder = _Recorder(linears + [(prefix + name, m) for name, m in routers(layer, experts)])
        routed = RoutedSums({}, {})
        try:
            with ExitStack() as measuring:
                for name, m in experts:
                    measuring.enter_context(routed.measuring(m, prefix + name))
                out = []
                for s, h in enumerate(hidden):
                    recorder.next_sequence()
                    out.append(stream.run(layer, h, calls[s][index]))
        finally:
            recorder.close()
    # on the host: the merged pass merges a layer's host weights with them (on the host they are these tensors)
    grams = {name: (total / tokens).to(torch.float32).to("cpu").contiguous() for name, total in recorder.sums.items()}
    for kind, found in ((EXPERT_SUMS, routed.sums), (EXPERT_COUNTS, routed.counts)):
        grams.update({kind + name: value.to("cpu").contiguous() for name, value in sorted(found.items())})
    return out, grams, dict(sorted(recorder.shares.items()))


def _save(grams: dict[str, torch.Tensor], shares: dict[str, str], tokens: int, path: Path) -> None:
    durable_save(grams, path, metadata={METADATA_KEY: json.dumps({"inputs": shares, "tokens": tokens})})


# (checkpoint name, each model's value in float32, each model's Gram of that linear's input or None) -> the merged
# value in float32: the merge a merged pass runs its layers with.
MergeWeight = Callable[[str, "list[torch.Tensor]", "list[torch.Tensor] | None"], "torch.Tensor"]


def measure_merged(streams: Sequence[ModelStream], batches: list[Batch], out: Path, journal: Path,
                   merge: MergeWeight, *, on_layer: Callable[[int], None] | None = None,
                   reserve: Reserve = unreserved) -> None:
    """RegMean++'s Grams: each model's layer l measured on the hidden states the **merged** model's layers before l
    give (its embeddings merged too), written as :func:`measure_model` writes them (model i's files under
    ``layer_file(i, l)``); after layer l's Grams, the layer is merged by ``merge`` from every model's weights and
    those Grams, and run to give layer l + 1 its input. The hidden states are journaled in ``journal`` as
    :func:`measure_model` journals them, so a killed pass resumes after the last layer journaled."""
    layers = streams[0].layers
    if all((out / layer_file(i, layers - 1)).is_file() for i in range(len(streams))):
        return
    for i in range(len(streams)):
        (out / layer_file(i, 0)).parent.mkdir(parents=True, exist_ok=True)
    tokens = sum(int(mask.sum()) for _, mask in batches)

    def averaged(key: str) -> torch.Tensor:
        return merge(key, [s.reader.read(key) for s in streams], None)

    with torch.no_grad():
        entering = streams[0].inputs(batches, read=averaged)
    step = _MergedStep(streams, [c for _, c in entering], tokens, out, merge, on_layer, reserve)
    kept = _journal(journal)
    LayerPass(kept, layers, point="after_measure_layer", carries=Held(lambda: [step.calls])).run(
        step, [[h for h, _ in entering]], len(batches))
    kept.remove()


class _MergedStep(Step[None]):
    """RegMean++'s layer: every model's layer measured on the merged hidden states, then the layer merged from
    their weights and Grams and run to give the next layer its input."""

    def __init__(self, streams: Sequence[ModelStream], calls: list[list[LayerCall]], tokens: int, out: Path,
                 merge: MergeWeight, on_layer: Callable[[int], None] | None, reserve: Reserve) -> None:
        self.streams, self.calls, self.tokens, self.out = streams, calls, tokens, out
        self.merge, self.on_layer, self.reserve = merge, on_layer, reserve

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        if self.on_layer is not None:
            self.on_layer(index)
        states, streams, calls = hidden[0], self.streams, self.calls
        measured = []
        for i, stream in enumerate(streams):
            with self.reserve(f"layer {index} of model {i + 1}", "layer"):
                _, grams, shares = _recorded_layer(stream, index, states, calls, self.tokens)
            _save(grams, shares, self.tokens, self.out / layer_file(i, index))
            measured.append((grams, shares))

        def merged(key: str) -> torch.Tensor:
            linear = key.removesuffix(".weight")
            values = [s.reader.read(key) for s in streams]
            if key.endswith(".weight") and all(linear in shares for _, shares in measured):
                return self.merge(key, values, [grams[shares[linear]] for grams, shares in measured])
            return self.merge(key, values, None)

        first = streams[0]
        module = first.layers_list[index]
        with self.reserve(f"merged layer {index}", "layer"), first.loaded(module, read=merged) as layer:
            return [[first.run(layer, h, calls[s][index]) for s, h in enumerate(states)]]

    def finish(self, hidden: Hidden) -> None:
        return None

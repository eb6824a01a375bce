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
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from resumerge.errors import ModelInputError
from resumerge.forward.journal import durable_save, latest
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.inputs.grams import METADATA_KEY, layer_file
from resumerge.torch_import import torch

HIDDEN_PREFIX = "hidden-"


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


def measure_model(stream: ModelStream, batches: list[tuple[torch.Tensor, torch.Tensor]], out: Path, index: int,
                  journal: Path, *, on_layer: Callable[[int], None] | None = None,
                  after_layer: Callable[[], None] | None = None) -> None:
    """Write the Gram file of each decoder layer of the model ``stream`` runs (the ``index``-th measured model) under
    ``out``, journaling the hidden states in ``journal`` and resuming after the last layer journaled there.
    ``on_layer(l)`` is told before layer l is read, ``after_layer()`` after it is durable (a kill point). Nothing
    is done for a model whose last layer's file is there already: its pass had finished."""
    layers = stream.layers
    if (out / layer_file(index, layers - 1)).is_file():
        return
    (out / layer_file(index, 0)).parent.mkdir(parents=True, exist_ok=True)
    journal.mkdir(parents=True, exist_ok=True)
    tokens = sum(int(mask.sum()) for _, mask in batches)
    with torch.no_grad():
        entering = stream.inputs(batches)
        calls = [c for _, c in entering]
        start, hidden = _restart(journal, len(batches))
        if hidden is None:
            hidden = [h for h, _ in entering]
        for layer_index in range(start, layers):
            if on_layer is not None:
                on_layer(layer_index)
            hidden = _layer(stream, layer_index, hidden, calls, out / layer_file(index, layer_index), tokens)
            _journal(hidden, journal, layer_index)
            if after_layer is not None:
                after_layer()
    shutil.rmtree(journal, ignore_errors=True)


def _journal(hidden: list[torch.Tensor], journal: Path, index: int) -> None:
    """The hidden states leaving layer ``index``, durable in ``journal``; then the older layer's file deleted (a
    kill between the two leaves both, and a resume takes the newest)."""
    name = f"{HIDDEN_PREFIX}{index:05d}.safetensors"
    durable_save({f"hidden.{s}": h.contiguous() for s, h in enumerate(hidden)}, journal / name)
    for older in journal.glob(f"{HIDDEN_PREFIX}*.safetensors"):
        if older.name != name:
            older.unlink(missing_ok=True)


def _layer(stream: ModelStream, index: int, hidden: list[torch.Tensor], calls: list[list[LayerCall]], path: Path,
           tokens: int) -> list[torch.Tensor]:
    """Run layer ``index`` over every sequence, recording its linears' Grams into ``path``; the layer's outputs."""
    out, grams, shares = _recorded_layer(stream, index, hidden, calls, tokens)
    _save(grams, shares, tokens, path)
    return out


def _recorded_layer(stream: ModelStream, index: int, hidden: list[torch.Tensor], calls: list[list[LayerCall]],
                    tokens: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, str]]:
    """Layer ``index`` of ``stream`` run over every sequence with its linears' inputs recorded: its outputs, the
    float32 Grams by the linear holding each, and which linear holds each linear's Gram."""
    module = stream.layers_list[index]
    with stream.loaded(module) as layer:
        linears = linears_of(layer, stream.prefix(module))
        if not linears:
            raise ModelInputError(f"decoder layer {index} of {type(stream.model).__name__} has no torch.nn.Linear to "
                                  "measure (GPT-2's Conv1D, for one, is not measured yet)",
                                  path=str(stream.reader.directory))
        recorder = _Recorder(linears)
        try:
            out = []
            for s, h in enumerate(hidden):
                recorder.next_sequence()
                out.append(stream.run(layer, h, calls[s][index]))
        finally:
            recorder.close()
    grams = {name: (total / tokens).to(torch.float32).contiguous() for name, total in recorder.sums.items()}
    return out, grams, dict(sorted(recorder.shares.items()))


def _save(grams: dict[str, torch.Tensor], shares: dict[str, str], tokens: int, path: Path) -> None:
    durable_save(grams, path, metadata={METADATA_KEY: json.dumps({"inputs": shares, "tokens": tokens})})


# (checkpoint name, each model's value in float32, each model's Gram of that linear's input or None) -> the merged
# value in float32: the merge a merged pass runs its layers with.
MergeWeight = Callable[[str, "list[torch.Tensor]", "list[torch.Tensor] | None"], "torch.Tensor"]


def measure_merged(streams: Sequence[ModelStream], batches: list[tuple[torch.Tensor, torch.Tensor]], out: Path,
                   journal: Path, merge: MergeWeight, *, on_layer: Callable[[int], None] | None = None,
                   after_layer: Callable[[], None] | None = None) -> None:
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
    journal.mkdir(parents=True, exist_ok=True)
    tokens = sum(int(mask.sum()) for _, mask in batches)
    first = streams[0]

    def averaged(key: str) -> torch.Tensor:
        return merge(key, [s.reader.read(key) for s in streams], None)

    with torch.no_grad():
        entering = first.inputs(batches, read=averaged)
        calls = [c for _, c in entering]
        start, hidden = _restart(journal, len(batches))
        if hidden is None:
            hidden = [h for h, _ in entering]
        for index in range(start, layers):
            if on_layer is not None:
                on_layer(index)
            measured = []
            for i, stream in enumerate(streams):
                _, grams, shares = _recorded_layer(stream, index, hidden, calls, tokens)
                _save(grams, shares, tokens, out / layer_file(i, index))
                measured.append((grams, shares))

            def merged(key: str, measured: list[tuple[dict[str, torch.Tensor], dict[str, str]]] = measured
                       ) -> torch.Tensor:
                linear = key.removesuffix(".weight")
                values = [s.reader.read(key) for s in streams]
                if key.endswith(".weight") and all(linear in shares for _, shares in measured):
                    return merge(key, values, [grams[shares[linear]] for grams, shares in measured])
                return merge(key, values, None)

            module = first.layers_list[index]
            with first.loaded(module, read=merged) as layer:
                hidden = [first.run(layer, h, calls[s][index]) for s, h in enumerate(hidden)]
            _journal(hidden, journal, index)
            if after_layer is not None:
                after_layer()
    shutil.rmtree(journal, ignore_errors=True)


def _restart(journal: Path, sequences: int) -> tuple[int, list[torch.Tensor] | None]:
    """The layer to start at and the hidden states entering it, from the journal (0 and None: from the start)."""
    found = latest(journal, HIDDEN_PREFIX)
    if found is None:
        return 0, None
    from safetensors.torch import load_file

    layer, path = found
    data = load_file(str(path))
    return layer + 1, [data[f"hidden.{s}"] for s in range(sequences)]

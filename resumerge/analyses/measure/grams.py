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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeAlias

from resumerge.errors import ModelInputError
from resumerge.forward.engine.handed import Held
from resumerge.forward.engine.standins import LayerCall
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.journal import Journal, durable_save
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.job.placement import Placement, model_layer
from resumerge.forward.text.batches import Batch, Hidden
from resumerge.inputs.grams import METADATA_KEY, layer_file
from resumerge.machine.torch_import import torch

HIDDEN_PREFIX = "hidden-"
# A mixture of experts' layer file also holds, float64, each fused experts stack's sums of squared inputs per expert
# ([E, n_in], by the stack's checkpoint name) and each experts module's tokens routed to each expert ([E]), the
# importance matrix's entries (``measure --imatrix``) of weights that have no Gram.
EXPERT_SUMS = "expert-sums:"
EXPERT_COUNTS = "expert-counts:"


class _Recorder:
    """The hooks on one layer's linears: each distinct input's float64 Σ x·xᵀ, and which linear's sum each
    linear shares (found on the first sequence, the same for every sequence: one module's code); each sequence's
    inputs are told apart by a hook before the ``layer`` itself, which every sequence's run calls."""

    def __init__(self, layer: torch.nn.Module, linears: Sequence[tuple[str, torch.nn.Module]]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.shares: dict[str, str] = {}
        self._seen: list[tuple[torch.Tensor, str]] = []  # this sequence's inputs, held: no address is reused
        self._handles = [layer.register_forward_pre_hook(self._next_sequence)]
        self._handles += [module.register_forward_pre_hook(self._hook(name)) for name, module in linears]

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

    def _next_sequence(self, layer: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._seen.clear()

    def close(self) -> None:
        self._seen.clear()
        for handle in self._handles:
            handle.remove()


def linears_of(layer: torch.nn.Module, prefix: str) -> list[tuple[str, torch.nn.Module]]:
    """Every ``torch.nn.Linear`` of ``layer`` by its checkpoint module name (``prefix`` + its name in the layer)."""
    return [(prefix + name, module) for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)]


# A layer's float32 Grams by the linear holding each, and which linear holds each linear's Gram (a string: this
# module is imported where torch is not, and annotations are not evaluated).
Grams: TypeAlias = "tuple[dict[str, torch.Tensor], dict[str, str]]"


class GramWatch:
    """The measurement's :class:`~resumerge.forward.job.placement.NodeWatch`: each model's layer run with its linears'
    inputs recorded, its Grams found as the layer ends, where it runs (this process, or the model's node on Ray,
    whose copy of this watch computes them there): the float32 Grams (the sums over ``tokens``, the real positions
    of the texts) by the linear holding each, and which linear holds each linear's Gram. The measurement's step
    takes them (:meth:`taken`) and writes them, in this process whichever ran the layer: the same bytes."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.found: dict[int, Grams] = {}

    def order(self, models: int) -> Iterable[int]:
        return range(models)

    @contextmanager
    def watching(self, stream: ModelStream, m: int, module: torch.nn.Module) -> Iterator[None]:
        """Model ``m``'s decoder layer ``module`` recorded while the block runs it (its weights read in the block:
        the hooks are on its modules, which keep them)."""
        from resumerge.forward.sums.routed import RoutedSums, fused_experts, routers

        prefix = stream.prefix(module)
        linears = linears_of(module, prefix)
        if not linears:
            index = next(i for i, layer in enumerate(stream.layers_list) if layer is module)
            raise ModelInputError(f"decoder layer {index} of {type(stream.model).__name__} has no torch.nn.Linear to "
                                  "measure (GPT-2's Conv1D, for one, is not measured yet)",
                                  path=str(stream.reader.directory))
        # A mixture of experts' layer (measured for --imatrix): its routers (matrices over the hidden states that
        # are not nn.Linear) get Grams as linears do, and its fused experts the importance pass's per-expert sums
        # and counts (what llama-imatrix records of a MUL_MAT_ID: no Gram of one expert's inputs is kept).
        experts = fused_experts(module)
        recorder = _Recorder(module, linears + [(prefix + name, r) for name, r in routers(module, experts)])
        routed = RoutedSums({}, {})
        try:
            with ExitStack() as measuring:
                for name, e in experts:
                    measuring.enter_context(routed.measuring(e, prefix + name))
                yield
        finally:
            recorder.close()
        tokens = self.tokens
        # on the host: the merged pass merges a layer's host weights with them (on the host they are these tensors)
        grams = {name: (total / tokens).to(torch.float32).to("cpu").contiguous()
                 for name, total in recorder.sums.items()}
        for kind, found in ((EXPERT_SUMS, routed.sums), (EXPERT_COUNTS, routed.counts)):
            grams.update({kind + name: value.to("cpu").contiguous() for name, value in sorted(found.items())})
        self.found[m] = (grams, dict(sorted(recorder.shares.items())))

    def end_layer(self) -> None:
        """Nothing: each model's Grams are found as its layer ends."""

    def taken(self, m: int) -> Grams:
        return self.found.pop(m)

    def put(self, m: int, found: object) -> None:
        assert isinstance(found, tuple), "a copy of a GramWatch finds Grams"
        self.found[m] = found


def tokens_of(batches: list[Batch]) -> int:
    """The real positions of ``batches``: what a Gram's sums are divided by."""
    return sum(int(mask.sum()) for _, mask in batches)


def measure_model(placement: Placement, watch: GramWatch, batches: list[Batch], out: Path, index: int,
                  journal: Path, *, on_layer: Callable[[int], None] | None = None) -> None:
    """Write the Gram file of each decoder layer of the one model ``placement`` runs (the ``index``-th measured
    model; its layers recorded by ``watch``, where they run) under ``out``, journaling the hidden states in
    ``journal`` and resuming after the last layer journaled there, on the one journaled layer pass
    (:class:`~resumerge.forward.job.layerpass.LayerPass`, kill point ``after_measure_layer`` once a layer is durable).
    ``on_layer(l)`` is told before layer l is read; the placement admits each layer's step. Nothing is done for a
    model whose last layer's file is there already: its pass had finished."""
    layers = placement.layers
    if (out / layer_file(index, layers - 1)).is_file():
        return
    (out / layer_file(index, 0)).parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        entering = placement.enter(batches)
    step = _ModelStep(placement, watch, lambda layer: out / layer_file(index, layer), on_layer)
    kept = _journal(journal)
    LayerPass(kept, layers, point="after_measure_layer", carries=placement).run(step, entering, len(batches))
    kept.remove()


def _journal(folder: Path) -> Journal:
    """A measurement's journal: the hidden states leaving each layer (one model's: ``hidden.<batch>``)."""
    return Journal(folder, HIDDEN_PREFIX, hidden="hidden.{s}")


class _ModelStep(Step[None]):
    """One model's Grams: each layer run by its placement over every sequence, its Gram file written
    (``path(layer)``) before the hidden states leaving it are journaled."""

    def __init__(self, placement: Placement, watch: GramWatch, path: Callable[[int], Path],
                 on_layer: Callable[[int], None] | None) -> None:
        self.placement, self.watch, self.path, self.on_layer = placement, watch, path, on_layer

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        if self.on_layer is not None:
            self.on_layer(index)
        out, _ = self.placement.layer(index, hidden, None)
        grams, shares = self.watch.taken(0)
        _save(grams, shares, self.watch.tokens, self.path(index))
        return out

    def finish(self, hidden: Hidden) -> None:
        return None


def _recorded_layer(stream: ModelStream, index: int, hidden: list[torch.Tensor], calls: list[list[LayerCall]],
                    tokens: int) -> Grams:
    """Layer ``index`` of ``stream`` run over every sequence (its merged pass's hidden states) with its linears'
    inputs recorded (:class:`GramWatch`): its Grams."""
    watch = GramWatch(tokens)
    module = stream.layers_list[index]
    with watch.watching(stream, 0, module):
        model_layer(stream, index, hidden, calls, None)
    return watch.taken(0)


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
    tokens = tokens_of(batches)

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
                grams, shares = _recorded_layer(stream, index, states, calls, self.tokens)
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

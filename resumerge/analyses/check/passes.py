"""The forward pass of a check: every model (the merge first) run one decoder layer at a time over the same token
sequences, on the forward engine (:mod:`resumerge.forward`), in float32.

At layer l each model's layer is read once and run twice: on that model's own hidden states (its real forward), and
on the reference's input to the layer (the base's, else the first parent's), so the merge's and each other model's
outputs for the same input can be compared (the localising pass); where the two inputs are the same to the bit (the
first layer, when the models' embeddings are) it runs once. Only one layer of one model is held, plus every model's
hidden states; with the static pass folded in (:mod:`resumerge.analyses.check.folded`) the base runs first in each layer
and its weights are kept until the layer's last model has run. After each layer the hidden states and the figures so far
are saved (temp file, fsync, rename) and the previous layer's file deleted: a killed check resumes at the layer it
reached and ends with the same figures. The heads run last, one model and one batch at a time
(:mod:`resumerge.analyses.check.heads`).

:func:`run_pass` drives the pass and journals it; where the models run is a :class:`PassModels`: this process, one
model after another (:class:`LocalModels`), or an actor per model on a Ray cluster
(:mod:`resumerge.analyses.check.onray`). Both compute each model's layer with :func:`model_layer` and its head figures
with :func:`compared`, and the figures of a layer come from :func:`layer_row` in the driver: the journal is the same
file whichever ran it.

The sequences run in batches (:func:`batches_of`: padded on the right to the longest of the batch, with the
attention mask), so a layer is one call over many sequences rather than one per sequence: a causal layer's output at
a real position never sees the padding after it, and every figure is taken over real positions only."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resumerge.analyses.check.folded import FoldedStatic
from resumerge.analyses.check.heads import HeadTotals, head_figures, kl_at, nll_sum, shared, targets_of
from resumerge.analyses.check.heads import logprobs as streamed_logprobs
from resumerge.analyses.check.models import Checked
from resumerge.analyses.check.vocabs import SharedVocab, own_batches
from resumerge.forward import Weights, durable_save
from resumerge.forward.journal import latest
from resumerge.forward.stream import LayerCall, ModelStream
from resumerge.store.killpoints import reach
from resumerge.torch_import import torch

LAYER_PREFIX = "layer-"
# The layer file's metadata entry holding the static figures the layers' reads found (resumerge.analyses.check.folded).
FOLDED = "static"
# The padded tokens (sequences x longest) a batch may hold: a layer's activations (an MLP's widest, 1024 x its
# intermediate size in float32) stay about 100 MB on a 70B model.
BATCH_TOKENS = 1024
# Holds the memory of one step of the pass while it runs: (what, step) -> a context manager.
Reserve = Callable[[str, str], AbstractContextManager[object]]
_TINY = 1e-12


@dataclass(frozen=True)
class PassFigures:
    """Per model (the merge first): ``nll``; ``kl``, ``kl_p95``, ``top1`` of the merge from it (None for the
    merge); per layer ``drift`` (of the merge's hidden states from its) and ``depart`` (of the merge's layer
    output from its, on the same input, relative to its layer's own change of that input); per layer the
    ``spread`` of the other models' outputs among themselves, on that input; ``base_kl`` KL(base ‖ this) for each
    parent where there is a base (the yardstick of "no effect")."""

    nll: list[float]
    kl: list[float | None]
    kl_p95: list[float | None]
    top1: list[float | None]
    drift: list[list[float]]
    depart: list[list[float]]
    spread: list[float]
    tokens: int
    base_kl: list[float | None]


def _unreserved(what: str, step: str) -> AbstractContextManager[object]:
    return nullcontext()


def streams_of(models: Sequence[Checked]) -> list[ModelStream]:
    """Each model's modules without weights (read as the pass runs). Models whose config.json says the same share
    one set of modules (built once: 0.9 s each for SmolLM2-135M): the pass gives a module its weights only while
    it runs, one model at a time, and takes them away after."""
    import json

    built: dict[str, tuple[Any, Any]] = {}
    streams = []
    for m in models:
        same = json.dumps(m.opened.config, sort_keys=True)
        stream = ModelStream(Weights.of(m.opened.directory, m.opened.tensors, m.remote, m.reads), m.opened.config,
                             torch.float32, what="resumerge check", key=m.role, built=built.get(same))
        built.setdefault(same, (stream.config, stream.model))
        streams.append(stream)
    return streams


def forward_pass(models: Sequence[Checked], streams: Sequence[ModelStream], sequences: Sequence[Sequence[int]],
                 workdir: Path, on_model: Callable[[int, int], None] | None = None,
                 reserve: Reserve = _unreserved, fold: FoldedStatic | None = None,
                 vocab: SharedVocab | None = None) -> PassFigures | None:
    """Run the pass in this process (resuming the one journaled in ``workdir``) and return its figures;
    ``on_model(layer, m)`` is told before model ``m``'s layer is read (``status`` shows it); ``reserve(what,
    step)`` holds the memory of a step (``layer``: one model's layer, two with ``fold``; ``heads``: two models'
    heads and log-probabilities) while it runs. ``fold``: the decoder layers' static figures are taken as they
    are read (:mod:`.folded`), and the pass stops (None) at the first layer whose merge holds a non-finite value.
    ``vocab``: how the models' vocabularies meet where they differ (each reads ``sequences`` as its own ids; the
    heads compare over the shared tokens: :mod:`.vocabs`)."""
    return run_pass([m.role for m in models], LocalModels(streams, workdir, on_model, reserve, fold, vocab),
                    sequences, workdir, fold)


class PassModels(Protocol):
    """Where the pass's models run, model by model (the merge first): this process (:class:`LocalModels`) or a Ray
    actor each (:mod:`.onray`). :func:`run_pass` drives either the same way, and journals alike."""

    @property
    def layers(self) -> int: ...

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Each model's hidden states entering its first decoder layer, per batch (their layers' calls kept)."""

    def runs_batched(self) -> bool:
        """Whether the merge's first layer runs the batches :meth:`enter` was given (see :func:`_runs_batched`)."""

    def layer(self, index: int, hidden: list[list[torch.Tensor]], reference: int | None
              ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """Each model's layer ``index`` on its own ``hidden`` states and on the reference's (its own output where it
        is the reference or there is none): both, per model."""

    def heads(self, hidden: list[list[torch.Tensor]], batches: Sequence[Sequence[Sequence[int]]],
              base: int | None) -> HeadTotals:
        """The figures from every model's head over its last ``hidden`` states (see :func:`compared`)."""


def run_pass(roles: Sequence[str], models: PassModels, sequences: Sequence[Sequence[int]],
             workdir: Path, fold: FoldedStatic | None = None) -> PassFigures | None:
    """The pass over ``models`` (resuming the one journaled in ``workdir``, whichever ran it) and its figures;
    ``fold``: the static figures the layers' reads found, journaled with each layer (None returned, the pass
    stopped, once they hold a non-finite value)."""
    workdir.mkdir(parents=True, exist_ok=True)
    reference = roles.index("base") if "base" in roles else (1 if len(roles) > 1 else None)
    groups = batches_of(sequences)
    with torch.no_grad():
        batches = [_padded([sequences[i] for i in group]) for group in groups]
        entering = models.enter(batches)
        if any(len(g) > 1 for g in groups) and not models.runs_batched():
            groups = [[i] for g in groups for i in g]  # this family's layers take one sequence at a time
            batches = [_padded([sequences[i] for i in group]) for group in groups]
            entering = models.enter(batches)
        real = [mask.bool() for _, mask in batches]
        start, hidden, stats, metadata = _restart(workdir, len(roles), len(batches))
        if hidden is None:
            hidden = entering
        if fold is not None and FOLDED in metadata:
            fold.restore(metadata[FOLDED])
        for index in range(start, models.layers):
            if fold is not None and fold.nonfinite():
                return None
            same_input = hidden[reference] if reference is not None else None
            hidden, on_same = models.layer(index, hidden, reference)
            stats.append(layer_row(hidden, on_same, same_input, real))
            _save(workdir, index, hidden, stats, {FOLDED: fold.to_json()} if fold is not None else None)
            reach("after_check_layer")  # tests kill the check here: it resumes after this layer
        if fold is not None and fold.nonfinite():
            return None
        found = models.heads(hidden, [[sequences[i] for i in g] for g in groups],
                             roles.index("base") if "base" in roles else None)
        return _figures(found, stats)


class LocalModels:
    """The pass's models run in this process, one layer of one model at a time (see :func:`forward_pass`)."""

    def __init__(self, streams: Sequence[ModelStream], workdir: Path,
                 on_model: Callable[[int, int], None] | None = None, reserve: Reserve = _unreserved,
                 fold: FoldedStatic | None = None, vocab: SharedVocab | None = None) -> None:
        self.streams, self.workdir, self.on_model, self.reserve = streams, workdir, on_model, reserve
        self.fold, self.vocab = fold, vocab
        self.layers = streams[0].layers
        self.entering: list[tuple[torch.Tensor, list[LayerCall]]] = []
        self.calls: list[list[list[LayerCall]]] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []  # the merge's own ids, for runs_batched

    def enter(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[torch.Tensor]]:
        own = [own_batches(self.vocab, m, batches) for m in range(len(self.streams))]
        entering = [stream.inputs_of_rows(own[m]) for m, stream in enumerate(self.streams)]
        self.batches = own[0]
        self.entering = entering[0]
        self.calls = [[c for _, c in model] for model in entering]
        return [[h for h, _ in model] for model in entering]

    def runs_batched(self) -> bool:
        return _runs_batched(self.streams[0], self.entering, self.reserve, self.batches)

    def layer(self, index: int, hidden: list[list[torch.Tensor]], reference: int | None
              ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        same_input = hidden[reference] if reference is not None else None
        n = len(self.streams)
        own: list[list[torch.Tensor]] = [[] for _ in range(n)]
        on_same: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for m in self.fold.order() if self.fold is not None else range(n):
            stream = self.streams[m]
            if self.on_model is not None:
                self.on_model(index, m)
            watching = self.fold.watching(stream.reader, m) if self.fold is not None else nullcontext()
            with self.reserve(f"layer {index} of model {m + 1}", "layer"), watching:
                out, theirs = model_layer(stream, index, hidden[m], self.calls[m],
                                          None if m == reference else same_input)
            own[m] = out
            on_same[m] = out if theirs is None else theirs
        if self.fold is not None:
            self.fold.end_layer()
        return own, on_same

    def heads(self, hidden: list[list[torch.Tensor]], batches: Sequence[Sequence[Sequence[int]]],
              base: int | None) -> HeadTotals:
        """Streamed: one model, one batch, one sequence's log-probabilities at a time (:mod:`.heads`)."""
        with self.reserve("the heads", "heads"):
            return head_figures(self.streams, hidden, batches, base, self.workdir, self.vocab)


def _runs_batched(stream: ModelStream, entering: list[tuple[torch.Tensor, list[LayerCall]]],
                  reserve: Reserve = _unreserved, batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                  ) -> bool:
    """Whether the model's first decoder layer runs a padded batch (some families' attention, as transformers
    ships it, cannot: DeepSeek-V3's with a padding mask); decided from the model alone, so a resumed check decides
    the same."""
    with reserve("layer 0 of model 1 (can it run batches?)", "layer"), stream.loaded(stream.layers_list[0]) as layer:
        return batched_on(stream, layer, entering, batches)


def batched_on(stream: ModelStream, layer: torch.nn.Module, entering: list[tuple[torch.Tensor, list[LayerCall]]],
               batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> bool:
    """Whether the model's first decoder ``layer`` (its weights loaded) runs every padded batch of ``entering``
    and, given the ``batches`` (ids, mask) they come from, gives each sequence what it gives it alone
    (:meth:`~resumerge.forward.stream.ModelStream.pads_alike`)."""
    try:
        outputs = [stream.run(layer, hidden, calls[0]) for hidden, calls in entering]
    except RuntimeError:
        return False
    return batches is None or stream.pads_alike(layer, batches, entering, outputs)


def batches_of(sequences: Sequence[Sequence[int]], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """The sequences' indices in batches: longest first, each batch as many as fit ``budget`` padded tokens (one
    at least), so that sequences of like length share a batch and little is padding."""
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * len(sequences[groups[-1][0]]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padded_positions(sequences: Sequence[Sequence[int]]) -> int:
    """The positions the pass's batches hold, padding included (what its hidden states and logits are sized by)."""
    return sum(len(g) * len(sequences[g[0]]) for g in batches_of(sequences))


def largest_batch(sequences: Sequence[Sequence[int]]) -> int:
    """The padded positions of the pass's largest batch (what one batch's logits are sized by)."""
    return max((len(g) * len(sequences[g[0]]) for g in batches_of(sequences)), default=0)


def _padded(batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded on the right with id 0 (never attended to: it comes after every real token) and the
    attention mask, both (batch, longest)."""
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, :len(s)] = torch.tensor(list(s))
        mask[row, :len(s)] = 1
    return ids, mask


def model_layer(stream: ModelStream, index: int, own: list[torch.Tensor], calls: list[list[LayerCall]],
                same: list[torch.Tensor] | None, loaded: bool = False
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One model's layer ``index``, read once: its output on its ``own`` hidden states (per batch) and, unless
    ``same`` is None, on ``same`` (the reference's input to the layer). Where ``same`` equals ``own`` to the bit
    (the first layer of models with the same embeddings) its output is the same and is not computed twice.
    ``loaded``: the layer holds its weights already (read for another step, not read again); it is left without
    them, as after a read."""
    equal = same is not None and all(a is b or torch.equal(a, b) for a, b in zip(own, same))
    module = stream.layers_list[index]
    with _held(stream, module) if loaded else stream.loaded(module) as layer:
        out = [stream.run(layer, h, calls[s][index]) for s, h in enumerate(own)]
        theirs = None if same is None or equal else [stream.run(layer, h, calls[s][index])
                                                      for s, h in enumerate(same)]
    return out, out if equal else theirs


@contextmanager
def _held(stream: ModelStream, module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module``, whose weights are loaded already, for the block; without them after."""
    try:
        yield module
    finally:
        stream.unload(module)


def layer_row(own: list[list[torch.Tensor]], on_same: list[list[torch.Tensor]],
              same_input: list[torch.Tensor] | None, real: list[torch.Tensor]) -> list[float]:
    """A layer's figures from every model's outputs: per model its drift and departure, then the spread."""
    n = len(own)
    sums = _Sums(real)
    drift = [0.0] + [sums.relative(own[0], own[m]) for m in range(1, n)]
    depart, spread = [0.0] * n, 0.0
    if same_input is not None:
        depart = [0.0] + [sums.relative(on_same[0], on_same[m], same_input) for m in range(1, n)]
        others = range(1, n)
        spread = max((sums.relative(on_same[a], on_same[b], same_input) for a in others for b in others
                      if a != b), default=0.0)
    return [*drift, *depart, spread]


class _Sums:
    """The squared distances :func:`layer_row` compares, over the real positions of every batch, each taken once:
    a model's real positions are selected once, and ‖a − b‖² is ‖b − a‖² to the bit (a float's negation is
    exact), so the spread's pairs each way and the departures' scales reuse what was found (a third of the
    reductions, a seventh of the selections of computing each figure alone)."""

    def __init__(self, real: list[torch.Tensor]) -> None:
        self.real = real
        self.picked: dict[int, list[torch.Tensor]] = {}
        self.found: dict[tuple[int, int], float] = {}

    def _pick(self, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        key = id(hidden[0])
        if key not in self.picked:
            self.picked[key] = [h[r] for h, r in zip(hidden, self.real)]
        return self.picked[key]

    def _squared(self, a: list[torch.Tensor], b: list[torch.Tensor] | None) -> float:
        """Σ over batches of ‖a − b‖² (``b`` None: ‖a‖²) at the real positions, in float64."""
        key = (id(a[0]), 0) if b is None else (min(id(a[0]), id(b[0])), max(id(a[0]), id(b[0])))
        if key not in self.found:
            x = self._pick(a)
            y = None if b is None else self._pick(b)
            self.found[key] = sum(float((p if q is None else p - q).double().pow(2).sum())
                                  for p, q in zip(x, y if y is not None else [None] * len(x)))
        return self.found[key]

    def relative(self, merge: list[torch.Tensor], other: list[torch.Tensor],
                 entering: list[torch.Tensor] | None = None) -> float:
        """‖merge − other‖ / ‖other − entering‖ over the real positions of every batch (``entering`` None:
        / ‖other‖)."""
        gap, scale = self._squared(merge, other), self._squared(other, entering)
        return float((gap / max(scale, _TINY)) ** 0.5)


def _save(workdir: Path, index: int, hidden: list[list[torch.Tensor]], stats: list[list[float]],
          metadata: dict[str, str] | None = None) -> None:
    tensors = {f"hidden.{m}.{s}": h.contiguous() for m, model in enumerate(hidden) for s, h in enumerate(model)}
    tensors["stats"] = torch.tensor(stats, dtype=torch.float64)
    durable_save(tensors, workdir / f"{LAYER_PREFIX}{index:05d}.safetensors", metadata)
    for older in workdir.glob(f"{LAYER_PREFIX}*.safetensors"):
        if older.name != f"{LAYER_PREFIX}{index:05d}.safetensors":
            older.unlink(missing_ok=True)


def _restart(workdir: Path, models: int, sequences: int
             ) -> tuple[int, list[list[torch.Tensor]] | None, list[list[float]], dict[str, str]]:
    """Where a journaled pass resumes: the next layer, the hidden states, the rows so far and the last layer
    file's metadata (the static figures found, :data:`FOLDED`)."""
    found = latest(workdir, LAYER_PREFIX)
    if found is None:
        return 0, None, [], {}
    from safetensors import safe_open

    layer, path = found
    with safe_open(str(path), "pt") as opened:
        hidden = [[opened.get_tensor(f"hidden.{m}.{s}") for s in range(sequences)] for m in range(models)]
        stats = [list(map(float, row)) for row in opened.get_tensor("stats").tolist()]
        metadata = opened.metadata() or {}
    return layer + 1, hidden, stats, dict(metadata)


@dataclass(frozen=True)
class ModelHead:
    """One model's figures from its head: its ``nll`` and, for a model other than the merge, per sequence the KL of
    the merge from it at each position (``kl``), the positions where their top tokens agree (``top1``), and the
    KL of it from the base at each position (``base_kl``; None for the base itself, or without a base)."""

    nll: float
    kl: list[torch.Tensor] | None = None
    top1: int = 0
    base_kl: list[torch.Tensor] | None = None


def logprobs(stream: ModelStream, states: list[torch.Tensor], batches: Sequence[Sequence[Sequence[int]]]
             ) -> list[torch.Tensor]:
    """The model's log-probabilities at every real position that has a next token (one tensor per sequence, in
    batch order), from its last decoder layer's outputs ``states``: :func:`.heads.logprobs`'s, all
    held (a Ray actor's, which the other models' actors compare with)."""
    return [lp for rows in streamed_logprobs(stream, states, batches) for lp in rows]


def compared(found: list[torch.Tensor], merged: list[torch.Tensor] | None, base: list[torch.Tensor] | None,
             batches: Sequence[Sequence[Sequence[int]]], vocab: SharedVocab | None = None, m: int = 0) -> ModelHead:
    """Model ``m``'s figures from its log-probabilities ``found``, against the merge's (``merged``; None: it is the
    merge) and the base's (``base``; None: none to compare with), both as :func:`~.heads.shared` gives them (over
    the shared tokens where the vocabularies differ: ``vocab``)."""
    targets = [t for batch in targets_of(batches, vocab, m) for t in batch]
    tokens = sum(len(t) for t in targets)
    nll = _nll(found, targets, tokens)
    if merged is None:
        return ModelHead(nll)
    theirs = [shared(vocab, m, lp) for lp in found]
    return ModelHead(nll, [kl_at(t, o) for t, o in zip(theirs, merged)],
                       sum(int((t.argmax(-1) == o.argmax(-1)).sum()) for t, o in zip(theirs, merged)),
                       None if base is None else [kl_at(b, t) for b, t in zip(base, theirs)])


def totals(heads: list[ModelHead], tokens: int) -> HeadTotals:
    """The head figures of every model (the merge first) from each one's own (:func:`compared`), ``tokens`` the
    positions predicted: what :func:`~resumerge.analyses.check.heads.head_figures` finds streamed, the same numbers."""
    n = len(heads)
    kl: list[float | None] = [None] * n
    p95: list[float | None] = [None] * n
    top1: list[float | None] = [None] * n
    base_kl: list[float | None] = [None] * n
    for m, found in enumerate(heads):
        if found.kl is None:
            continue
        per_position = torch.cat(found.kl)
        kl[m] = float(per_position.double().mean())
        p95[m] = float(torch.quantile(per_position.double(), 0.95))
        top1[m] = float(found.top1 / tokens)
        if found.base_kl is not None:
            base_kl[m] = float(torch.cat(found.base_kl).double().mean())
    return HeadTotals(nll=[h.nll for h in heads], kl=kl, kl_p95=p95, top1=top1, base_kl=base_kl, tokens=tokens)


def _figures(heads: HeadTotals, stats: list[list[float]]) -> PassFigures:
    """The pass's figures from the heads' and the layers' rows."""
    n = len(heads.nll)
    drift = [[row[m] for row in stats] for m in range(n)]
    depart = [[row[n + m] for row in stats] for m in range(n)]
    return PassFigures(nll=heads.nll, kl=heads.kl, kl_p95=heads.kl_p95, top1=heads.top1, drift=drift, depart=depart,
                       spread=[row[2 * n] for row in stats], tokens=heads.tokens, base_kl=heads.base_kl)


def _nll(found: list[torch.Tensor], targets: list[torch.Tensor], tokens: int) -> float:
    total = 0.0
    for lp, target in zip(found, targets):
        total = nll_sum(lp, target, total)
    return total / tokens

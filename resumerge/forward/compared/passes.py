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
(:mod:`resumerge.forward.compared.heads`).

:func:`run_pass` runs the check's :class:`~resumerge.forward.job.layerpass.Step` on the one journaled layer pass
(:class:`~resumerge.forward.job.layerpass.LayerPass`: its restart, loop, journal and kill point); where the models run
is a :class:`PassModels`, the forward engine's :class:`~resumerge.forward.job.placement.Placement` with the heads: this
process, one model after another (:class:`LocalModels`), or an actor per model on a Ray cluster
(:mod:`resumerge.forward.placing.rayactor`). Both compute each model's layer with
:func:`~resumerge.forward.job.placement.model_layer` and its head figures with :func:`compared`, and the figures of a
layer come from :func:`layer_row` in the driver: the journal is the same file whichever ran it.

The sequences run in batches (:mod:`resumerge.forward.text.batches`: padded on the right to the longest of the batch,
with the attention mask), and every figure is taken over real positions only."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from resumerge.forward.compared.heads import HeadTotals, head_figures, kl_at, nll_sum, shared, targets_of
from resumerge.forward.compared.heads import logprobs as streamed_logprobs
from resumerge.forward.engine.reader import CastReader, Weights
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.journal import Journal, Restart
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.job.placement import Placement, Streams, batched_on, model_layer
from resumerge.forward.opening.opened import PassModel
from resumerge.forward.text.batches import (
    BATCH_TOKENS,
    Batch,
    Hidden,
    batches_of,
    enter,
    largest_batch,
    padded_positions,
)
from resumerge.forward.text.vocabs import SharedVocab, own_batches
from resumerge.machine.torch_import import torch

__all__ = ["BATCH_TOKENS", "LAYER_PREFIX", "Fold", "LocalModels", "PassFigures", "PassModels", "batched_on",
           "batches_of", "compared", "forward_pass", "largest_batch", "logprobs", "model_layer", "padded_positions",
           "run_pass", "streams_of", "totals"]

LAYER_PREFIX = "layer-"
# The layer file's metadata entry holding the static figures the layers' reads found (resumerge.analyses.check.folded).
FOLDED = "static"
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


def streams_of(models: Sequence[PassModel], device: str = "cpu", dtype: torch.dtype | None = None,
               what: str = "resumerge check") -> list[ModelStream]:
    """Each model's modules without weights (read as the pass runs, each layer on ``device``: see
    :mod:`resumerge.forward.engine.device`), computing in ``dtype`` (None: float32, a check's), ``what`` naming the pass
    in the models' errors. Models whose config.json says the same share one set of modules (built
    once: 0.9 s each for SmolLM2-135M): the pass gives a module its weights only while it runs, one model at a
    time, and takes them away after."""
    import json

    built: dict[str, tuple[Any, Any]] = {}
    streams = []
    for m in models:
        same = json.dumps(m.opened.config, sort_keys=True)
        stream = ModelStream(Weights.of(m.opened.directory, m.opened.tensors, m.remote, m.reads), m.opened.config,
                             torch.float32 if dtype is None else dtype, what=what, key=m.role, built=built.get(same),
                             device=device)
        built.setdefault(same, (stream.config, stream.model))
        streams.append(stream)
    return streams


def forward_pass(models: Sequence[PassModel], streams: Sequence[ModelStream], sequences: Sequence[Sequence[int]],
                 workdir: Path, on_model: Callable[[int, int], None] | None = None,
                 reserve: Reserve = unreserved, fold: Fold | None = None,
                 vocab: SharedVocab | None = None) -> PassFigures | None:
    """Run the pass in this process (resuming the one journaled in ``workdir``) and return its figures;
    ``on_model(layer, m)`` is told before model ``m``'s layer is read (``status`` shows it); ``reserve(what,
    step)`` holds the memory of a step (``layer``: one model's layer, two with ``fold``; ``heads``: two models'
    heads and log-probabilities) while it runs. ``fold``: the decoder layers' static figures are taken as they
    are read (:mod:`resumerge.analyses.check.folded`), and the pass stops (None) at the first layer whose merge holds a
    non-finite value. ``vocab``: how the models' vocabularies meet where they differ (each reads ``sequences`` as its
    own ids; the heads compare over the shared tokens: :mod:`resumerge.forward.text.vocabs`)."""
    return run_pass([m.role for m in models], LocalModels(streams, workdir, on_model, reserve, fold, vocab),
                    sequences, workdir, fold)


class Fold(Protocol):
    """The static figures taken from the decoder layers' reads as the pass reads them (the check's
    :class:`~resumerge.analyses.check.folded.FoldedStatic`), journaled with each layer: what the pass asks of them."""

    def order(self) -> list[int]:
        """The order the models run in within a layer."""

    def watching(self, reader: CastReader, model: int) -> AbstractContextManager[None]:
        """Take the figures of what ``reader`` (of model ``model``) reads in the block."""

    def end_layer(self) -> None:
        """The layer's last model has run."""

    def nonfinite(self) -> bool:
        """Whether the merge holds a non-finite value so far."""

    def to_json(self) -> str:
        """The figures so far, as journaled with the layer."""

    def restore(self, text: str) -> None:
        """Take back the figures a layer's journal holds."""


class PassModels(Placement, Protocol):
    """Where the check's models run (:class:`~resumerge.forward.job.placement.Placement`), with their heads: this
    process (:class:`LocalModels`) or a Ray actor each (:mod:`resumerge.forward.placing.rayactor`). :func:`run_pass`
    drives either the same way, and journals alike."""

    def heads(self, hidden: Hidden, batches: Sequence[Sequence[Sequence[int]]], base: int | None) -> HeadTotals:
        """The figures from every model's head over its last ``hidden`` states (see :func:`compared`)."""


def run_pass(roles: Sequence[str], models: PassModels, sequences: Sequence[Sequence[int]],
             workdir: Path, fold: Fold | None = None) -> PassFigures | None:
    """The pass over ``models`` (resuming the one journaled in ``workdir``, whichever ran it) and its figures;
    ``fold``: the static figures the layers' reads found, journaled with each layer (None returned, the pass
    stopped, once they hold a non-finite value)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        entered = enter(sequences, models.enter, models.runs_batched)
    step = _CheckStep(roles, models, entered.real(models.before()), entered.sequences(sequences), fold)
    layers = LayerPass(Journal(workdir, LAYER_PREFIX), models.layers, point="after_check_layer", carries=models)
    return layers.run(step, entered.hidden, len(entered.batches))


class _CheckStep(Step[PassFigures]):
    """The check's part of the pass: each layer run by every model on its own hidden states and on the
    reference's input (the base's, else the first parent's), the layer's figures (:func:`layer_row`) journaled
    beside the hidden states with the static figures folded in so far; after the last layer, the heads."""

    def __init__(self, roles: Sequence[str], models: PassModels, real: list[torch.Tensor],
                 batches: Sequence[Sequence[Sequence[int]]], fold: Fold | None) -> None:
        self.models, self.real, self.batches, self.fold = models, real, batches, fold
        self.base = roles.index("base") if "base" in roles else None
        self.reference = self.base if self.base is not None else (1 if len(roles) > 1 else None)
        self.stats: list[list[float]] = []

    def restore(self, restart: Restart) -> None:
        if "stats" in restart.tensors:
            self.stats = [list(map(float, row)) for row in restart.tensors["stats"].tolist()]
        if self.fold is not None and FOLDED in restart.metadata:
            self.fold.restore(restart.metadata[FOLDED])

    def stopped(self) -> bool:
        return self.fold is not None and self.fold.nonfinite()

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        # (the reference's input as its forward gives it: a residual sum between two parts, a loop's start)
        same_input = self.models.entered(index, hidden, self.reference) if self.reference is not None else None
        hidden, on_same = self.models.layer(index, hidden, self.reference, same_input)
        self.stats.append(layer_row(hidden, on_same, same_input, self.real))
        return hidden

    def kept(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
        return {"stats": torch.tensor(self.stats, dtype=torch.float64)}, \
            {FOLDED: self.fold.to_json()} if self.fold is not None else None

    def finish(self, hidden: Hidden) -> PassFigures:
        return _figures(self.models.heads(hidden, self.batches, self.base), self.stats)


class _Folding:
    """:class:`Fold` as the forward engine's :class:`~resumerge.forward.job.placement.Watch`."""

    def __init__(self, fold: Fold) -> None:
        self.fold = fold

    def order(self, models: int) -> Iterable[int]:
        return self.fold.order()

    @contextmanager
    def watching(self, stream: ModelStream, m: int, module: torch.nn.Module) -> Iterator[None]:
        with self.fold.watching(stream.reader, m):
            yield

    def end_layer(self) -> None:
        self.fold.end_layer()


class LocalModels(Streams):
    """The pass's models run in this process, one layer of one model at a time (see :func:`forward_pass`)."""

    def __init__(self, streams: Sequence[ModelStream], workdir: Path | None,
                 on_model: Callable[[int, int], None] | None = None, reserve: Reserve = unreserved,
                 fold: Fold | None = None, vocab: SharedVocab | None = None) -> None:
        def own(m: int, batches: list[Batch]) -> list[Batch]:
            return own_batches(vocab, m, batches)

        super().__init__(streams, on_model, reserve, _Folding(fold) if fold is not None else None,
                         own if vocab is not None else None)
        self.workdir, self.vocab = workdir, vocab

    def heads(self, hidden: Hidden, batches: Sequence[Sequence[Sequence[int]]], base: int | None) -> HeadTotals:
        """Streamed: one model, one batch, one sequence's log-probabilities at a time (:mod:`.heads`)."""
        assert self.workdir is not None, "a pass with heads keeps their log-probabilities in its workdir"
        with self.reserve("the heads", "heads"):
            return head_figures(self.streams, hidden, batches, base, self.workdir, self.vocab)


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
    positions predicted: what :func:`~resumerge.forward.compared.heads.head_figures` finds streamed, the same
    numbers."""
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

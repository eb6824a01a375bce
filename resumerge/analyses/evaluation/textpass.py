"""The pass of a text task (:mod:`.texttasks`): the scored models (and a KL task's parent, last) run one decoder layer
of one model at a time over the texts on the forward engine's journaled pass (:class:`~resumerge.forward.job.layerpass.
LayerPass`: each layer's hidden states saved durably, a killed pass resumed at the layer it reached), then
:func:`~.texttasks.text_heads`. :func:`text_pass` runs it on any placement (this process, a population of
unwritten candidates); :func:`score_texts` runs it in this process under the pass's admission and keeps the
figures, so that a pass asked again is answered from its folder without reading a weight."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from resumerge.analyses.evaluation.status import LAYER_PREFIX
from resumerge.analyses.evaluation.texttasks import TextFigures, text_heads
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import AnswerFile
from resumerge.forward.job.journal import Journal
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.job.placement import Placement, Streams
from resumerge.forward.text.batches import Batch, Hidden, enter
from resumerge.forward.text.vocabs import SharedVocab, own_batches
from resumerge.machine.torch_import import torch

FIGURES = "figures.json"
# (hidden states leaving the last layer, the token sequences of each batch) -> the figures
Heads = Callable[[Hidden, Sequence[Sequence[Sequence[int]]]], TextFigures]


class _TextStep(Step[TextFigures]):
    """Each layer run by every model on its own hidden states; after the last, the heads."""

    def __init__(self, placement: Placement, heads: Callable[[Hidden], TextFigures]) -> None:
        self.placement, self.heads = placement, heads

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        own, _ = self.placement.layer(index, hidden, None)
        return own

    def finish(self, hidden: Hidden) -> TextFigures:
        return self.heads(hidden)


def text_pass(placement: Placement, sequences: Sequence[Sequence[int]], workdir: Path, heads: Heads,
              point: str) -> TextFigures:
    """The pass over ``placement``'s models and ``sequences``, resuming the one journaled in ``workdir``
    (``point``: the kill point after each layer's file is durable), and the figures ``heads`` finds. The models'
    bytes are proved against the journal by the pass's job before it runs (``EvalJob.proved``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        entered = enter(sequences, placement.enter, placement.runs_batched)
    batches = entered.sequences(sequences)
    step = _TextStep(placement, lambda hidden: heads(hidden, batches))
    found = LayerPass(Journal(workdir, LAYER_PREFIX), placement.layers, point, carries=placement).run(
        step, entered.hidden, len(entered.batches))
    assert found is not None  # the step never stops the pass
    return found


def _figures_doc(figures: TextFigures) -> object:
    return figures.to_json()


def figures_file(workdir: Path) -> AnswerFile[TextFigures]:
    """The figures of the pass journaled in ``workdir``, kept once it finished (its answer cache)."""
    return AnswerFile(workdir / FIGURES, TextFigures.from_json, _figures_doc)


def score_texts(streams: Sequence[ModelStream], sequences: Sequence[Sequence[int]], workdir: Path, *,
                parent: bool, reserve: Reserve = unreserved, on_model: Callable[[int, int], None] | None = None,
                on_heads: Callable[[], None] | None = None, point: str = "after_eval_layer",
                vocab: SharedVocab | None = None) -> TextFigures:
    """The figures of the models ``streams`` (with a ``parent``: the last one, every other measured from it) on
    ``sequences``, the pass journaled in ``workdir`` (answered from it once finished); ``reserve`` admits each
    model's layer (step ``layer``) and the heads (step ``heads``); ``on_model(layer, m)`` is told before model
    ``m``'s layer is read, ``on_heads()`` before the heads. ``vocab``: how the parent's other vocabulary meets the
    scored models' (check's :class:`~resumerge.forward.text.vocabs.SharedVocab`, model 0 theirs, 1 the
    parent's): each model reads the texts as its own ids of the same tokens."""
    kept = figures_file(workdir)
    done = kept.read()
    if done is not None:
        return done
    count = len(streams) - (1 if parent else 0)

    def own(m: int, batches: list[Batch]) -> list[Batch]:
        return own_batches(vocab, 0 if m < count else 1, batches)

    placement = Streams(streams, on_model, reserve, own_batches=own if vocab is not None else None)

    def heads(hidden: Hidden, batches: Sequence[Sequence[Sequence[int]]]) -> TextFigures:
        if on_heads is not None:
            on_heads()
        with reserve("the heads", "heads"):
            return text_heads(streams, hidden, batches, parent, vocab)

    figures = text_pass(placement, sequences, workdir, heads, point)
    kept.write(figures)
    Journal(workdir, LAYER_PREFIX).clear()
    return figures

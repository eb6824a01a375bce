"""A pass's scoring on the forward engine: every run of a :class:`~.requests.Scoring` through the model one decoder
layer at a time (each layer read once for all of them), then the head, and each request's log-likelihood and
whether its continuation is the greedy one.

Journaled in its own folder: after each layer the hidden states of every batch (temp file, fsync, rename; the
previous layer's file deleted), after the head of each batch that batch's answers, and at the end all answers
(``answers.json``), after which the layer files go. A killed pass resumes at the layer, or the batch, it reached,
and ends with the same answers; a pass asked again is answered from its file without reading a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from resumerge.analyses.evaluation.requests import Scoring
from resumerge.analyses.evaluation.status import LAYER_PREFIX
from resumerge.analyses.evaluation.tails import tail_answers
from resumerge.forward.engine.stream import ModelStream
from resumerge.forward.job.driver import AnswerFile
from resumerge.forward.job.journal import Journal
from resumerge.forward.job.layerpass import LayerPass, Reserve, Step, unreserved
from resumerge.forward.job.placement import Placement
from resumerge.forward.text.batches import Hidden, enter
from resumerge.machine.torch_import import torch

ANSWERS = "answers.json"
Answer = tuple[float, bool]
# Where a pass's decoder layers run (``(reserve, on_layer)`` -> the placement, for the block): this process or a Ray
# actor, as the executor placed the pass (:mod:`.placed`).
Places = Callable[[Reserve, Callable[[int], None]], AbstractContextManager[Placement]]


def _answers(doc: Any) -> list[Answer]:
    return [(float(lp), bool(greedy)) for lp, greedy in doc]


def answers_file(workdir: Path) -> AnswerFile[list[Answer]]:
    """The answers of the pass journaled in ``workdir``, kept once it finished (its answer cache)."""
    return AnswerFile(workdir / ANSWERS, _answers)


def _batch_answers(doc: Any) -> dict[int, Answer]:
    return {int(request): (float(lp), bool(greedy)) for request, (lp, greedy) in doc}


def _batch_doc(found: dict[int, Answer]) -> object:
    return sorted(found.items())


def _kept_heads(workdir: Path, batch: int) -> AnswerFile[dict[int, Answer]]:
    """The answers of batch ``batch``'s head, kept as it ends (a pass resumed in its head skips that batch)."""
    return AnswerFile(workdir / f"heads-{batch:06d}.json", _batch_answers, _batch_doc)


def score(stream: ModelStream, work: Scoring, workdir: Path, places: Places, *, reserve: Reserve = unreserved,
          on_layer: Callable[[int | None], None] | None = None) -> list[Answer]:
    """Each request's (log-likelihood, greedy) of ``work`` on the model ``stream`` (float32 as lm-eval's ``hf``
    model computes them), resuming the pass journaled in ``workdir``, its answers kept there last
    (:func:`answers_file`); ``on_layer`` is told each layer as it starts (None: the heads); ``reserve(what, step)``
    holds a step's memory while it runs. A client of the forward engine's one journaled pass
    (:class:`~resumerge.forward.job.layerpass.LayerPass`). ``places(reserve, on_layer)``: where the decoder layers run
    (this process, or a Ray actor with ``--executor ray``: the same answers, the journal the same file); the head
    runs here. The models' bytes are proved against the journal before (the pass's job:
    :meth:`~.job.EvalJob.proved`)."""
    told = on_layer if on_layer is not None else (lambda layer: None)
    with places(reserve, told) as placement:
        return _scored(placement, stream, work, workdir, reserve, told)


def _scored(streams: Placement, stream: ModelStream, work: Scoring, workdir: Path, reserve: Reserve,
            told: Callable[[int | None], None]) -> list[Answer]:
    """:func:`score`'s pass with its layers where ``streams`` runs them, its head on ``stream``."""
    workdir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        entered = enter(work.runs, streams.enter, streams.runs_batched)
    journal = Journal(workdir, LAYER_PREFIX)
    step = _Scored(streams, stream, work, entered.groups, workdir, reserve, told)
    answers = LayerPass(journal, streams.layers, point="after_eval_layer", carries=streams).run(
        step, entered.hidden, len(entered.batches))
    assert answers is not None  # the step never stops the pass
    answers_file(workdir).write(answers)
    journal.clear()
    for path in workdir.glob("heads-*.json"):
        path.unlink(missing_ok=True)
    return answers


class _Scored(Step[list[Answer]]):
    """The pass's step: each decoder layer over every batch (its weights read once), then the head."""

    def __init__(self, streams: Placement, stream: ModelStream, work: Scoring, groups: list[list[int]],
                 workdir: Path, reserve: Reserve, told: Callable[[int | None], None]) -> None:
        self.streams, self.stream, self.work, self.groups, self.workdir = streams, stream, work, groups, workdir
        self.reserve, self.told = reserve, told

    def layer(self, index: int, hidden: Hidden) -> Hidden:
        own, _ = self.streams.layer(index, hidden, None)
        return own

    def finish(self, hidden: Hidden) -> list[Answer]:
        self.told(None)
        return _heads(self.stream, self.work, self.groups, hidden[0], self.workdir, self.reserve)


def _heads(stream: ModelStream, work: Scoring, groups: list[list[int]], hidden: list[torch.Tensor], workdir: Path,
           reserve: Reserve) -> list[Answer]:
    """Every request's answer from the head over the last hidden states, batch by batch (a batch's answers
    journaled as it ends)."""
    readers: dict[int, list[int]] = {}
    for request, run in enumerate(work.run_of):
        readers.setdefault(run, []).append(request)
    answers: list[Answer | None] = [None] * len(work.run_of)
    todo = []
    for b in range(len(groups)):
        kept = _kept_heads(workdir, b).read()
        if kept is None:
            todo.append(b)
        else:
            for request, answer in kept.items():
                answers[request] = answer
    with reserve("the head", "heads"):
        for b in todo:
            runs = groups[b]
            wanted = [[work.targets[request] for request in readers.get(run, [])] for run in runs]
            found: dict[int, Answer] = {}
            for run, row in zip(runs, tail_answers(stream, hidden[b], [len(work.runs[i]) for i in runs], wanted)):
                for request, answer in zip(readers.get(run, []), row):
                    found[request] = answer
            _kept_heads(workdir, b).write(found)
            for request, answer in found.items():
                answers[request] = answer
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]
